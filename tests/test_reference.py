"""The flag reference and the parser come from one declaration (issues 30 and 46): docs/cli.md is what ``extract.cli.reference`` renders, ``extract run``'s flags are ``JobSpec``'s fields, and every other command's are its dataclasses' fields."""

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
    assert set(parser_flags) == declared, set(parser_flags) ^ declared
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


def test_every_command_is_declared_once_and_in_the_reference():
    """Each command's parser is built from its dataclasses' fields (one flag or argument a field, nothing
    else), --help shows each default from the declaration, and docs/cli.md has a section with every flag."""
    import importlib

    from extract.cli.extract import declared as run_flags
    from extract.cli.reference import command_flags
    from extract.cli.startup import COMMANDS

    page = cli_page()
    declared = command_flags()
    assert set(declared) == {name for name, (module, _) in COMMANDS.items() if module != "extract"}
    for name, arguments in {"run": run_flags(), **declared}.items():
        module = importlib.import_module(f"extract.cli.{COMMANDS[name][0]}")
        parser = module.build_parser() if name == "run" else module.LINE.build_parser()
        parser_dests = [a.dest for a in parser._actions if a.dest != "help"]
        assert parser_dests == [a.dest for a in arguments], name
        section = page.split(f"## `extract {name}`\n", 1)[1].split("\n## ", 1)[0]
        for argument in arguments:
            assert f"| `{argument.cell()}` |" in section, (name, argument.dest)
            shown = argument.shown_default
            if shown is not None and not isinstance(shown, bool) and shown not in ((), []):
                assert argument.help().endswith(")") and "(default " in argument.help(), (name, argument.dest)
                # the declared help never copies the default: the builder adds it, once
                assert "default" not in argument.declared.help_text(), (name, argument.dest)


def test_a_commands_defaults_are_its_dataclasses_defaults():
    from extract.analysis.options import ProbeOptions, ReportConfig
    from extract.cli import probe, report, top
    from extract.cli.base import values

    assert values(probe.LINE.parse_args(["s.zarr"]), ProbeOptions) == ProbeOptions()
    assert values(report.LINE.parse_args(["s.zarr"]), ReportConfig) == ReportConfig()
    parsed = values(top.LINE.parse_args(["s.zarr", "--layer", "x", "-k", "3", "--latents", "1,5"]), top.TopOptions)
    assert (parsed.k, parsed.latents, str(parsed.out)) == (3, [1, 5], "top")
