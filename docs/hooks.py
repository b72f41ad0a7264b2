"""mkdocs hooks: the front page is the README, and the data under ``results/`` is published
beside the pages.

``docs/index.md`` holds the line ``<!-- include: README.md -->``: the site's front page is the
repository's README, with its links into ``docs/`` made relative to the site.

The pages link to measured data and plots with repository-root links such as
``/results/optimizers/loss_curves.svg`` (which also work when the markdown is read on a code
host). With ``validation.links.absolute_links: relative_to_docs`` mkdocs checks such links
against the site's files; :func:`on_files` adds every file under ``results/`` to those files
(as ``results/...``), so a link to a data file that does not exist fails the strict build.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parent.parent
SKIP_SUFFIXES = (".pyc",)
INCLUDE_README = "<!-- include: README.md -->"


class DataFile(File):
    """A file under ``results/``, copied as it is (a ``.md`` there is data, not a page)."""

    def is_documentation_page(self) -> bool:
        return False


def on_files(files: Files, config: Any) -> Files:
    results = ROOT / "results"
    for path in sorted(results.rglob("*")):
        if not path.is_file() or path.suffix in SKIP_SUFFIXES or "__pycache__" in path.parts:
            continue
        rel = path.relative_to(ROOT).as_posix()
        files.append(DataFile(rel, src_dir=str(ROOT), dest_dir=config["site_dir"],
                              use_directory_urls=False))
    return files


def on_page_markdown(markdown: str, page: Page, config: Any, files: Files) -> str:
    if page.file.src_uri != "index.md" or INCLUDE_README not in markdown:
        return markdown
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    readme = re.sub(r"\]\(docs/", "](", readme)            # docs/x.md -> x.md
    readme = re.sub(r"\]\((results/)", r"](/\1", readme)   # results/... -> the data files
    return markdown.replace(INCLUDE_README, readme)
