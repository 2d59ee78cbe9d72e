"""The docs site builds strictly, and its API reference covers every public name.

``mkdocs build --strict`` fails on a broken link or an unknown page. What it cannot see
(mkdocstrings renders a name without a docstring silently) is checked here: every name in
``dtrec.__all__``, and every name in the ``__all__`` of a public sub-package, has a
docstring, and every name in ``dtrec.__all__`` is rendered by a ``::: dtrec.<name>``
line of docs/reference/.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import dtrec

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "reference"
BUILD_BUDGET_S = 60  # it runs in the CI suite: it must stay well under a minute


def _documented(obj) -> bool:
    return bool((obj.__doc__ or "").strip())


def _rendered_names() -> set[str]:
    names = set()
    for page in REFERENCE.glob("*.md"):
        names.update(re.findall(r"^::: dtrec\.(\w+)\s*$", page.read_text(), re.M))
    return names


def test_every_public_name_has_a_docstring():
    missing = [n for n in dtrec.__all__ if not _documented(getattr(dtrec, n))]
    for name in dtrec.__all__:
        sub = getattr(dtrec, name)
        if inspect.ismodule(sub):
            for member in getattr(sub, "__all__", []):
                obj = getattr(sub, member)
                if inspect.isclass(obj) or inspect.isroutine(obj):
                    missing += [f"{name}.{member}"] * (not _documented(obj))
    assert not missing, f"public names without a docstring: {missing}"


def test_every_public_name_is_in_the_reference():
    rendered, public = _rendered_names(), set(dtrec.__all__)
    assert not public - rendered, (
        f"dtrec.__all__ names missing from docs/reference/*.md (add a '::: dtrec.<name>' "
        f"line): {sorted(public - rendered)}"
    )
    assert not rendered - public, (
        f"docs/reference/ renders names that are not public: {sorted(rendered - public)}"
    )


def test_readme_links_exist():
    """README.md is read on GitHub, outside the site: its relative links point at files."""
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text())
    local = [link for link in links if "://" not in link]
    assert local, "README.md links no page"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None
    or importlib.util.find_spec("mkdocstrings_handlers") is None
    or importlib.util.find_spec("material") is None,
    reason="the docs extra (mkdocs, mkdocs-material, mkdocstrings-python) is not installed: "
    "pip install -e '.[docs]' (make install tries it)",
)
def test_docs_site_builds_strict(tmp_path):
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    elapsed = time.monotonic() - start
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    assert elapsed < BUILD_BUDGET_S, f"the docs build took {elapsed:.0f} s"
    for page in ("index.html", "reference/distribute/index.html", "usage/index.html"):
        assert (tmp_path / page).exists(), page
    # the reference really holds the rendered docstrings, not empty headings
    html = (tmp_path / "reference" / "distribute" / "index.html").read_text()
    first_line = dtrec.distribute_module.__doc__.strip().split("\n")[0][:30]
    assert "distribute_module" in html and first_line.split("``")[0] in html
