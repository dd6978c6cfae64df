"""The docs build (issue 30): ``mkdocs build --strict`` of docs/ with mkdocs.yml passes, so every page is in
the nav and every link between pages (and every anchor it names) resolves; the README's links to docs/
name pages that exist. docs/cli.md, the flag reference, is generated from the code (tests/test_reference.py)
and built like every other page.
"""

from __future__ import annotations

import re
import shutil
import sys
import tomllib

import yaml
from helpers import ROOT, patience

DOCS = ROOT / "docs"


def test_mkdocs_build_strict_has_no_warnings(tmp_path):
    shutil.copytree(DOCS, tmp_path / "docs")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    config["docs_dir"], config["site_dir"] = str(tmp_path / "docs"), str(tmp_path / "site")
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    build = patience.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(tmp_path / "mkdocs.yml")],
                         capture_output=True, text=True, quiet=300)  # fmt: skip
    log = build.stdout + build.stderr
    assert build.returncode == 0 and "WARNING" not in log, log
    pages = {p.relative_to(tmp_path / "site").as_posix() for p in (tmp_path / "site").rglob("index.html")}
    assert {f"{p.stem}/index.html" for p in DOCS.glob("*.md") if p.stem != "index"} <= pages, sorted(pages)


def test_the_readme_links_to_pages_that_exist():
    links = re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text(encoding="utf-8"))
    assert len(links) >= 10, links
    missing = [link for link in links if not (ROOT / link).is_file()]
    assert not missing, missing


def test_mkdocs_is_in_the_test_extra():
    """CI installs ``.[test]`` and nothing else, and the build above needs mkdocs."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    test = project["optional-dependencies"]["test"]
    assert any(re.match(r"mkdocs\b(?!-)", requirement) for requirement in test), test
