"""The repository is self-contained: no tracked file cites a document outside the tree.

Every ``*.md`` a tracked file names must be a tracked file (found by its path, or by its name when the
reference is a bare file name), and nothing may point at the sibling folders the project was started
from (the paper's text, the shared notes). What the code cites lives in ``docs/``.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Built from pieces so that a grep of the tree for these strings finds only real offenders.
_OUTSIDE = re.compile(
    "|".join(
        re.escape(p)
        for p in (
            "../" + "shared",
            "../" + "seed",
            "/work/" + "shared",
            "/work/" + "seed",
            "ppd-paper" + ".txt",
            "seed/" + "ppd-paper",
        )
    )
)
_MD_REF = re.compile(r"(?<![\w./-])((?:\.{1,2}/)*[\w-][\w./-]*\.md)\b")
_URL_BEFORE = re.compile(r"(?:https?://|github\.com/|www\.)\S*$")

#: Names of files the code writes at run time, not documents in the tree.
GENERATED_MD = frozenset(
    {"report.md", "drift.md", "slo.md", "bidir.md", "admission.md"}
)  # loadgen/report/: report.py, drift.py, slo.py, bidir.py, admission.py

_TEXT_SUFFIXES = frozenset(
    {".py", ".pyi", ".md", ".toml", ".yaml", ".yml", ".sh", ".json", ".txt", ".cfg", ".ini", ".proto"}
)
_TEXT_NAMES = frozenset({"Makefile", "Dockerfile", ".gitignore"})


def tracked_files(root: Path) -> list[str]:
    out = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z"], check=True, capture_output=True, text=False
    ).stdout
    return [name for name in out.decode("utf-8").split("\0") if name]


def _is_text(name: str) -> bool:
    path = PurePosixPath(name)
    return path.suffix in _TEXT_SUFFIXES or path.name in _TEXT_NAMES


def _md_ref_ok(ref: str, citing: str, tracked: set[str], names: set[str]) -> bool:
    if "/" not in ref:
        return ref in names or ref in GENERATED_MD
    if ref.startswith("../") or "/../" in ref:
        joined = PurePosixPath(citing).parent / ref
        parts: list[str] = []
        for part in joined.parts:
            if part == "..":
                if not parts:
                    return False  # climbs out of the repository
                parts.pop()
            elif part != ".":
                parts.append(part)
        return "/".join(parts) in tracked
    ref = ref.removeprefix("./")
    return ref in tracked or any(t.endswith("/" + ref) for t in tracked)


def outside_references(root: Path, files: list[str]) -> list[str]:
    """``path:line: what`` for each reference in ``files`` (paths under ``root``) that leaves the tree."""
    tracked = set(files)
    names = {PurePosixPath(f).name for f in files}
    problems: list[str] = []
    for name in sorted(files):
        if not _is_text(name):
            continue
        try:
            text = (root / name).read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError):
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            for m in _OUTSIDE.finditer(line):
                problems.append(f"{name}:{lineno}: {m.group(0)!r} points outside the repository")
            for m in _MD_REF.finditer(line):
                if _URL_BEFORE.search(line[: m.start()]):
                    continue  # part of a web address (a public repository's file), not a local document
                ref = m.group(1)
                if not _md_ref_ok(ref, name, tracked, names):
                    problems.append(f"{name}:{lineno}: {ref!r} is not a document in the repository")
    return problems


_SITE = ("docs/", "tools/docs/")


def bare_doc_names(files: list[str]) -> list[str]:
    """``path:line: name`` for each page of docs/ named by its bare file name outside docs/ (a reader
    of a ``--help`` text or a package README must be able to find "docs/emulator-model.md 3.1"). The
    site's own links are relative to docs/ and mkdocs --strict checks them: the pages, mkdocs.yml's nav
    and what tools/docs/ writes into docs/reference/ are left to it."""
    pages = {
        PurePosixPath(f).name
        for f in files
        if f.startswith("docs/")
        and f.endswith(".md")
        and PurePosixPath(f).name not in ("README.md", "index.md")
    }
    problems = []
    for name in files:
        if name.startswith(_SITE) or name == "mkdocs.yml" or not _is_text(name):
            continue
        try:
            text = (ROOT / name).read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError):
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            for m in _MD_REF.finditer(line):
                if m.group(1) in pages:
                    problems.append(f"{name}:{lineno}: {m.group(1)}")
    return problems


def test_docs_pages_are_named_by_their_path() -> None:
    try:
        files = tracked_files(ROOT)
    except (OSError, subprocess.CalledProcessError) as exc:  # pragma: no cover - not a git checkout
        pytest.skip(f"git ls-files unavailable: {exc}")
    own = Path(__file__).resolve().relative_to(ROOT).as_posix()
    problems = bare_doc_names([f for f in files if f != own])
    assert not problems, "name these docs by their path (docs/NAME.md):\n" + "\n".join(problems)


def test_the_path_check_catches_a_bare_doc_name() -> None:
    files = ["docs/emulator-model.md", "docs/README.md", "tests/test_docs_self_contained.py"]
    problems = bare_doc_names(files)
    assert any(p.endswith(": emulator-model.md") for p in problems)  # this file names it bare below
    assert not any("docs/emulator-model.md" in p.split(": ", 1)[1] for p in problems)


# Our own issues ("issue 16 item 3"); another project's, cited with its tracker's #, are sources.
_ISSUE_NUMBER = re.compile(r"\bissues? \d+", re.IGNORECASE)
README_MAX_LINES = 200


def issue_numbers(root: Path, files: list[str]) -> list[str]:
    """``path:line: text`` for each issue number in the user docs (README.md and docs/): a reader has
    no issue tracker; the history lives in git."""
    problems: list[str] = []
    for name in files:
        if not (name == "README.md" or (name.startswith("docs/") and name.endswith(".md"))):
            continue
        for lineno, line in enumerate((root / name).read_text(encoding="utf-8").splitlines(), 1):
            problems.extend(f"{name}:{lineno}: {m.group(0)}" for m in _ISSUE_NUMBER.finditer(line))
    return problems


def test_the_user_docs_name_no_issue_numbers_and_the_readme_stays_short() -> None:
    try:
        files = tracked_files(ROOT)
    except (OSError, subprocess.CalledProcessError) as exc:  # pragma: no cover - not a git checkout
        pytest.skip(f"git ls-files unavailable: {exc}")
    problems = issue_numbers(ROOT, files)
    assert not problems, "issue numbers in the user docs:\n" + "\n".join(problems)
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move the detail into docs/"


def test_the_issue_number_check_catches_one(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("fine\nas issue 16 item 3 said\n")
    (tmp_path / "docs" / "a.md").write_text("(Issue 25); vLLM issue #26896 is a source\n")
    (tmp_path / "b.md").write_text("issue 7 outside the user docs\n")
    assert issue_numbers(tmp_path, ["README.md", "docs/a.md", "b.md"]) == [
        "README.md:2: issue 16",
        "docs/a.md:1: Issue 25",
    ]


def test_no_tracked_file_cites_a_document_outside_the_tree() -> None:
    try:
        files = tracked_files(ROOT)
    except (OSError, subprocess.CalledProcessError) as exc:  # pragma: no cover - not a git checkout
        pytest.skip(f"git ls-files unavailable: {exc}")
    # This file's own fixtures below name missing documents on purpose.
    own = Path(__file__).resolve().relative_to(ROOT).as_posix()
    problems = outside_references(ROOT, [f for f in files if f != own])
    assert not problems, "references that leave the tree:\n" + "\n".join(problems)


def test_the_cited_docs_exist_and_keep_their_cited_sections() -> None:
    """The section numbers code and READMEs cite are headings of the pages in docs/."""
    protocol = (ROOT / "docs" / "vllm-protocol.md").read_text(encoding="utf-8")
    for section in ("1.1", "1.2", "1.3", "1.4", "1.5", "1.6", "3.4", "3.5", "4.3"):
        assert re.search(rf"^### {re.escape(section)} ", protocol, re.M), section
    assert re.search(r"^## 9\. ", protocol, re.M)
    model = (ROOT / "docs" / "emulator-model.md").read_text(encoding="utf-8")
    for section in ("2.1", "2.2", "2.3", "2.4", "3.1", "3.3", "3.4"):
        assert re.search(rf"^### {re.escape(section)} ", model, re.M), section
    paper = (ROOT / "docs" / "paper.md").read_text(encoding="utf-8")
    assert "Not All Prefills Are Equal: PPD Disaggregation for Multi-turn LLM Serving" in paper


def test_the_check_catches_outside_references(tmp_path: Path) -> None:
    files = {
        "a.py": "# see " + "../" + "shared/docs/x.md section 2\n",
        "b.md": "the cost model (missing-model.md 3.1), the report (report.md)\n",
        "c/d.md": "up and out: [x](../../outside.md); in: [y](../b.md); https://github.com/o/r/blob/main/README.md\n",
        "e.md": "`docs/nowhere.md` and `c/d.md`\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text, encoding="utf-8")
    problems = outside_references(tmp_path, list(files))
    joined = "\n".join(problems)
    assert "a.py:1: '" + "../" + "shared' points outside" in joined
    assert "'missing-model.md'" in joined
    assert "'../../outside.md'" in joined
    assert "'docs/nowhere.md'" in joined
    for fine in ("report.md'", "'../b.md'", "'c/d.md'"):
        assert fine not in joined
    assert "README.md" not in joined
