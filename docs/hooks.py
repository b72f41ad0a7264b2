"""mkdocs hook: publish the data under ``results/`` beside the pages.

The pages link to measured data and plots with repository-root links such as
``/results/optimizers/loss_curves.svg`` (which also work when the markdown is read on a code
host). With ``validation.links.absolute_links: relative_to_docs`` mkdocs checks such links
against the site's files; this hook adds every file under ``results/`` to those files (as
``results/...``), so a link to a data file that does not exist fails the strict build.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
SKIP_SUFFIXES = (".pyc",)


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
