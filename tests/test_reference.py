"""The flag reference and the parser come from one declaration (issue 30): docs/cli.md is what ``extract.cli.reference`` renders, and ``extract run``'s flags are ``JobSpec``'s fields."""

from __future__ import annotations

from dataclasses import fields

from helpers import ROOT

from extract.cli.extract import build_parser
from extract.cli.reference import REGENERATE, cli_page, flag_table
from extract.job.spec import JobSpec, flag_of, job_options

NOT_JOB_OPTIONS = {"config", "list_layers", "help"}  # where options come from, or what to do instead of a job


def test_docs_cli_md_is_what_the_declaration_renders():
    page = ROOT / "docs" / "cli.md"
    assert page.exists(), f"docs/cli.md is missing; generate it: {REGENERATE}"
    assert page.read_text(encoding="utf-8") == cli_page(), f"docs/cli.md is out of date; regenerate it: {REGENERATE}"


def test_the_command_line_page_leads_to_the_reference_instead_of_copying_it():
    page = (ROOT / "docs" / "commands.md").read_text(encoding="utf-8")
    assert "| flag | meaning |" not in page and "(cli.md)" in page


def test_every_job_option_has_a_flag_and_every_flag_is_a_job_option():
    declared = {f.name for f, _ in job_options()}  # raises, naming the field, if one has no option(...)
    assert declared == {f.name for f in fields(JobSpec)}
    parser_flags = {a.dest: a.option_strings for a in build_parser()._actions if a.dest not in NOT_JOB_OPTIONS}
    assert set(parser_flags) == declared, (set(parser_flags) ^ declared)
    for f in fields(JobSpec):
        assert parser_flags[f.name] == [flag_of(f)], f.name
    table = flag_table()
    assert all(f"| `{flag_of(f)}" in table for f in fields(JobSpec)), "a job option is missing from the reference"


def test_the_kind_of_a_flag_follows_the_field_type():
    """A boolean is a switch that turns its default over; a list takes values; numbers are parsed."""
    actions = {a.dest: a for a in build_parser()._actions}
    assert actions["overwrite"].option_strings == ["--overwrite"] and actions["overwrite"].const is True
    assert actions["truncate"].option_strings == ["--no-truncate"] and actions["truncate"].const is False
    assert actions["pool"].nargs == actions["layers"].nargs == actions["layout"].nargs == "+"
    assert actions["batch_size"].type is int and actions["timeout"].type is float and actions["model"].type is None
    assert all(actions[f.name].default is None for f in fields(JobSpec))  # a TOML value stands unless a flag is given
