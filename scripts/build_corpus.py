"""A multi-domain demo corpus of real text, built from Debian packages and one PyPI wheel.

Examples and domain-mixture experiments need real text in several distinct styles, but the usual corpora live on
dataset hubs a training machine may not reach. Debian and PyPI are reachable almost everywhere and keep their files
for years, so every domain here is cut from packages fetched with ``apt-get download`` and ``pip download``, read
without installing anything, and cleaned deterministically: the same package versions always give byte-identical
JSONL files. Debian replaces package versions over time, so ``manifest.json`` records the exact versions and the
sha256 of every output.

    python scripts/build_corpus.py --output-dir data/corpus [--domains scripture quotes] [--cache-dir DIR] \\
        [--max-mb-per-domain N]

Only the quickstart and the examples use this corpus, so it is a script beside the library rather than part of it;
it needs nanotron installed (for its atomic file writes) and nothing else.
"""

import argparse
import gzip
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import unicodedata
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import NamedTuple

from nanotron.files import atomic_write

MANIFEST_FILE_NAME = "manifest.json"
MIN_DOCUMENT_CHARS = 20
BYTES_PER_MB = 1_000_000


class CorpusError(ValueError):
    """The corpus cannot be built as asked; the message names the domain, file or tool and how to fix it."""


class Document(NamedTuple):
    """One line of a domain's JSONL file."""

    id: str
    text: str


# What an extractor yields: a document id and its text before cleaning (raw bytes or already decoded).
RawDocument = tuple[str, str | bytes]


# --------------------------------------------------------------------------------------------------------------
# Cleaning and parsing (pure functions)
# --------------------------------------------------------------------------------------------------------------

_ANSI_ESCAPE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")
_OVERSTRIKE = re.compile(r".\x08")
_C0_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f]")
_TRAILING_WHITESPACE = re.compile(r"[ \t\f\v]+$", re.MULTILINE)
_BLANK_LINE_RUNS = re.compile(r"\n{3,}")


def decode_text(raw: bytes) -> str:
    """Decode UTF-8, falling back to latin-1: old text files are one or the other, and latin-1 never fails."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


def clean_text(raw: str | bytes) -> str:
    """Normalise one document so that equal content gives equal bytes, whatever tool or platform produced it.

    Line endings become ``\\n``; terminal colour codes, backspace overstrikes (bold/underline in ``nroff`` output)
    and other control characters except tabs go; text is NFC-normalised; trailing whitespace is stripped, runs of
    blank lines are squeezed to one and leading/trailing blank lines are dropped.
    """
    text = decode_text(raw) if isinstance(raw, bytes) else raw
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _ANSI_ESCAPE.sub("", text)
    text = _OVERSTRIKE.sub("", text)
    text = _C0_CONTROLS.sub("", text)
    text = unicodedata.normalize("NFC", text)
    text = _TRAILING_WHITESPACE.sub("", text)
    text = _BLANK_LINE_RUNS.sub("\n\n", text)
    return text.strip("\n")


def clean_documents(raw_documents: Iterable[RawDocument]) -> list[Document]:
    """Clean, drop documents under ``MIN_DOCUMENT_CHARS``, sort by id and drop exact duplicates.

    Duplicates are found by the sha1 of the cleaned text and the one with the smallest id wins, so the result does
    not depend on the order in which the sources were read.
    """
    documents = sorted(Document(doc_id, clean_text(raw)) for doc_id, raw in raw_documents)
    kept: list[Document] = []
    seen_ids: set[str] = set()
    seen_texts: set[bytes] = set()
    for document in documents:
        if document.id in seen_ids:
            raise ValueError(f"duplicate document id {document.id!r}")
        seen_ids.add(document.id)
        digest = hashlib.sha1(document.text.encode("utf-8")).digest()
        if len(document.text) >= MIN_DOCUMENT_CHARS and digest not in seen_texts:
            seen_texts.add(digest)
            kept.append(document)
    return kept


def cap_documents(documents: Sequence[Document], max_mb: float | None) -> list[Document]:
    """The first documents, in the given order, whose UTF-8 text adds up to at most ``max_mb`` megabytes."""
    if max_mb is None:
        return list(documents)
    budget = max_mb * BYTES_PER_MB
    kept: list[Document] = []
    for document in documents:
        budget -= len(document.text.encode("utf-8"))
        if budget < 0:
            break
        kept.append(document)
    return kept


def split_fortunes(text: str) -> list[str]:
    """Split a ``fortune`` data file into its entries, which are separated by lines holding a single ``%``."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    entries = f"\n{text}\n".split("\n%\n")
    return [entry.strip("\n") for entry in entries if entry.strip()]


_DICTD_DIGITS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
# dictfmt stores the database description under these headwords ("00-database-info", "00databaseshort", ...).
_DICTD_METADATA = re.compile(r"^00-?database")


def decode_dictd_number(code: str) -> int:
    """Decode a dictd index number: base 64, most significant digit first, digits ``A-Za-z0-9+/``."""
    value = 0
    for digit in code:
        position = _DICTD_DIGITS.find(digit)
        if position < 0:
            raise ValueError(f"{code!r} is not a dictd base-64 number")
        value = value * 64 + position
    return value


def slice_dictd(index: str, data: bytes) -> list[tuple[int, bytes]]:
    """The entries of a dictd dictionary as ``(offset, bytes)``, in offset order, each span once.

    Each ``.index`` line is ``headword<TAB>offset<TAB>length`` into the uncompressed ``.dict``. Several headwords
    often share one definition, so spans are deduplicated; spans of the ``00-database-*`` metadata (and of aliases
    pointing at them) are skipped because they describe the database rather than define words.
    """
    spans: set[tuple[int, int]] = set()
    metadata: set[tuple[int, int]] = set()
    for line in index.splitlines():
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) != 3:
            raise ValueError(f"dictd index line {line!r} does not have 3 tab-separated fields")
        headword, offset, length = fields
        span = (decode_dictd_number(offset), decode_dictd_number(length))
        (metadata if _DICTD_METADATA.match(headword) else spans).add(span)
    return [(offset, data[offset:offset + length]) for offset, length in sorted(spans - metadata)]


_KJV_HEADING = re.compile(r"^(?P<book>\S.*) (?P<chapter>\d+)$")
_KJV_VERSE = re.compile(r"^\s+\d+ (?P<text>.*)$")


def group_kjv_chapters(dump: str) -> list[Document]:
    """Group the output of ``bible -l0`` into one document per chapter, without verse numbers.

    The dump is a ``Book N`` heading line followed by ``  <verse> <text>`` lines. A chapter's document starts with
    its heading; ids (``kjv/01-genesis/001``) sort in canonical order.
    """
    chapters: list[tuple[str, list[str]]] = []
    book, book_number = "", 0
    for line in dump.splitlines():
        if not line.strip():
            continue
        if heading := _KJV_HEADING.match(line):
            if heading["book"] != book:
                book, book_number = heading["book"], book_number + 1
            slug = book.lower().replace(" ", "-")
            chapters.append((f"kjv/{book_number:02d}-{slug}/{int(heading['chapter']):03d}", [line]))
        elif not chapters:
            raise ValueError(f"KJV dump starts with {line!r} instead of a chapter heading")
        else:
            verse = _KJV_VERSE.match(line)
            chapters[-1][1].append(verse["text"] if verse else line.strip())
    return [Document(doc_id, f"{lines[0]}\n\n" + "\n".join(lines[1:])) for doc_id, lines in chapters]


# Lines that open a section of the plain-text Jargon File worth keeping: the centred preface title, chapters,
# lexicon entries (":headword: pronunciation, part of speech"), appendices and the bibliography. Headings use
# no-break spaces, hence the ``\s``.
_JARGON_SECTION = re.compile(r"^(?: {10,}Welcome\sto\sthe\sJargon\sFile$|Chapter\s\d+\.\s|Appendix\s[A-Z]\.\s"
                             r"|Bibliography$|   :[^:]+:)")
# Lines that open a table of contents or a list of headwords, which are dropped up to the next kept section.
_JARGON_LISTING = re.compile(r"^(?: +Part\s[IVX]+\.\s|Glossary$|  [0A-Z]$)")


def split_jargon_file(text: str) -> list[str]:
    """Split ``jargon.txt`` into its preface, chapters, lexicon entries, appendices and bibliography.

    Tables of contents and the per-letter headword lists are dropped: they are navigation, not prose.
    """
    sections: list[list[str]] = []
    keeping = False
    for line in text.splitlines():
        if _JARGON_SECTION.match(line):
            sections.append([line])
            keeping = True
        elif _JARGON_LISTING.match(line):
            keeping = False
        elif keeping:
            sections[-1].append(line)
    return ["\n".join(lines) for lines in sections]


# --------------------------------------------------------------------------------------------------------------
# Fetching packages
# --------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Package:
    """One downloadable source: a Debian binary package, or a PyPI wheel pinned to ``pin``."""

    name: str
    licence: str
    pin: str | None = None

    @property
    def registry(self) -> str:
        return "debian" if self.pin is None else "pypi"


@dataclass(frozen=True)
class FetchedPackage:
    """A package in the cache: the file to read and the exact version it holds, for the manifest."""

    package: Package
    path: Path
    version: str


def _progress(message: str) -> None:
    print(f"[corpus] {message}", file=sys.stderr, flush=True)


def _run(command: Sequence[str], input: bytes | None = None, cwd: Path | str | None = None,
         check: bool = False) -> subprocess.CompletedProcess:
    stdin = subprocess.DEVNULL if input is None else None
    return subprocess.run(command, input=input, stdin=stdin, capture_output=True, cwd=cwd, check=check)


def _last_error_line(stderr: bytes) -> str:
    lines = [line.strip() for line in decode_text(stderr).splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith(("E:", "ERROR"))]
    return (errors or lines or ["no error message"])[-1]


def _cached_file(directory: Path, pattern: str, what: str) -> Path | None:
    matches = sorted(directory.glob(pattern))
    if len(matches) > 1:
        names = ", ".join(match.name for match in matches)
        raise CorpusError(f"the cache {directory} holds several versions of {what} ({names}); "
                          f"delete the ones you do not want to build from")
    return matches[0] if matches else None


def _download_into(directory: Path, command: Sequence[str]) -> subprocess.CompletedProcess:
    """Run a command that downloads into its working folder, in a fresh folder, and move the files to ``directory``.

    Downloads land in the cache only once complete, so an interrupted run never leaves a truncated file behind
    that a later run would reuse.
    """
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory, prefix=".download-") as staging:
        result = _run(command, cwd=staging)
        if result.returncode == 0:
            for fetched in Path(staging).iterdir():
                os.replace(fetched, directory / fetched.name)
    return result


class _PackageCache:
    """Downloads packages into a cache folder (``deb/`` and ``pypi/``) and reuses the files already there."""

    def __init__(self, cache_dir: Path):
        self.deb_dir = cache_dir / "deb"
        self.wheel_dir = cache_dir / "pypi"
        self.apt_updated = False  # `apt-get update` runs at most once per build

    def fetch(self, packages: Sequence[Package]) -> list[FetchedPackage]:
        self._download_debs([package.name for package in packages if package.registry == "debian"])
        fetched = []
        for package in packages:
            if package.registry == "debian":
                deb = self._cached_deb(package.name)
                fetched.append(FetchedPackage(package, deb, _deb_version(deb)))
            else:
                fetched.append(FetchedPackage(package, self._fetch_wheel(package), package.pin))
        return fetched

    def _cached_deb(self, name: str) -> Path | None:
        return _cached_file(self.deb_dir, f"{name}_*.deb", name)

    def _download_debs(self, names: Sequence[str]) -> None:
        missing = [name for name in names if self._cached_deb(name) is None]
        if not missing:
            return
        result = _download_into(self.deb_dir, ["apt-get", "download", *missing])
        if result.returncode != 0 and os.geteuid() == 0 and not self.apt_updated:
            _progress("apt-get download failed; refreshing the package lists with `apt-get update`")
            _run(["apt-get", "update"])
            self.apt_updated = True
            result = _download_into(self.deb_dir, ["apt-get", "download", *missing])
        if result.returncode != 0:
            hint = "check that the Debian mirror is reachable" if self.apt_updated else \
                "run `sudo apt-get update` and retry"
            raise CorpusError(f"`apt-get download {' '.join(missing)}` failed ({_last_error_line(result.stderr)}); "
                              f"{hint}")

    def _fetch_wheel(self, package: Package) -> Path:
        pattern = f"{package.name}-{package.pin}-*.whl"
        if (wheel := _cached_file(self.wheel_dir, pattern, package.name)) is not None:
            return wheel
        requirement = f"{package.name}=={package.pin}"
        if importlib.util.find_spec("pip") is None:
            raise CorpusError(f"pip is not installed for {sys.executable}: install it, or put the wheel of "
                              f"{requirement} into {self.wheel_dir}")
        result = _download_into(self.wheel_dir, [sys.executable, "-m", "pip", "download", "--no-deps",
                                                 "--only-binary=:all:", "--disable-pip-version-check", "-d", ".",
                                                 requirement])
        if result.returncode != 0 or (wheel := _cached_file(self.wheel_dir, pattern, package.name)) is None:
            raise CorpusError(f"`pip download {requirement}` failed ({_last_error_line(result.stderr)}); "
                              f"check that PyPI is reachable")
        return wheel


def _deb_version(deb: Path) -> str:
    return decode_text(_run(["dpkg-deb", "-f", str(deb), "Version"], check=True).stdout).strip()


def _read_deb(deb: Path, select: Callable[[str], bool]) -> list[tuple[str, bytes]]:
    """The regular files of a ``.deb`` whose path (``usr/...``) passes ``select``, sorted by path.

    Files are streamed out of the data archive, so large packages never get unpacked to disk; symlinks are skipped
    because they only duplicate regular files.
    """
    files, archive_error = [], None
    with subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(deb)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE) as process:
        try:
            with tarfile.open(fileobj=process.stdout, mode="r|") as archive:
                for member in archive:
                    path = member.name.removeprefix("./")
                    if member.isfile() and select(path):
                        files.append((path, archive.extractfile(member).read()))
            process.stdout.read()  # the archive's end padding: dpkg-deb fails if it cannot write it
        except tarfile.TarError as error:
            archive_error = str(error)
        stderr = process.stderr.read()
    if process.returncode != 0 or archive_error:
        reason = _last_error_line(stderr) if process.returncode != 0 else archive_error
        raise CorpusError(f"cannot read {deb} ({reason}); delete it so that it is downloaded again")
    return sorted(files)


# --------------------------------------------------------------------------------------------------------------
# Extractors: downloaded packages -> raw documents
# --------------------------------------------------------------------------------------------------------------

Extractor = Callable[[Mapping[str, Path]], Iterator[RawDocument]]


def _deb_file_documents(files: Mapping[str, Path], pattern: re.Pattern[str]) -> Iterator[RawDocument]:
    """One document per file whose path matches ``pattern``, with id ``<package>/<the pattern's name group>``.

    Gzip-compressed files (``.gz``) are decompressed.
    """
    for package, deb in files.items():
        for path, data in _read_deb(deb, pattern.match):
            yield f"{package}/{pattern.match(path)['name']}", gzip.decompress(data) if path.endswith(".gz") else data


def _kjv_documents(files: Mapping[str, Path]) -> Iterator[RawDocument]:
    """Dump the KJV with the ``bible`` program of the package itself, unpacked next to its data, as any user."""
    with tempfile.TemporaryDirectory(prefix="nanotron-kjv-") as root:
        for deb in files.values():
            _run(["dpkg-deb", "-x", str(deb), root], check=True)
        try:
            result = _run([f"{root}/usr/bin/bible", "-p", f"{root}/usr/lib", "-l0", "gen1:1-rev22:21"])
            failure = None if result.returncode == 0 and result.stdout else _last_error_line(result.stderr)
        except OSError as error:
            failure = str(error)
    if failure is not None:
        raise CorpusError(f"the `bible` program of bible-kjv failed ({failure}); the scripture domain needs a "
                          f"machine that runs the Debian package's binary")
    yield from group_kjv_chapters(decode_text(result.stdout))


def _is_fortune_file(path: str) -> bool:
    """Fortune data files: not the ``.dat`` indexes, not the ``.u8`` copies, not the ``off/`` (offensive) sets."""
    parts = path.split("/")
    return path.startswith("usr/share/games/") and not path.endswith((".dat", ".u8")) and "off" not in parts


def _fortune_documents(files: Mapping[str, Path]) -> Iterator[RawDocument]:
    for package, deb in files.items():
        for path, data in _read_deb(deb, _is_fortune_file):
            name = path.removeprefix("usr/share/games/")
            for number, entry in enumerate(split_fortunes(decode_text(data))):
                yield f"{package}/{name}/{number:05d}", entry


def _dictd_documents(files: Mapping[str, Path]) -> Iterator[RawDocument]:
    for deb in files.values():
        contents = dict(_read_deb(deb, lambda path: path.startswith("usr/share/dictd/")))
        for index_path in sorted(path for path in contents if path.endswith(".index")):
            stem = index_path.removesuffix(".index")
            data = gzip.decompress(contents[f"{stem}.dict.dz"])  # dictzip is gzip with a seek table
            name = stem.rsplit("/", 1)[-1]
            for offset, entry in slice_dictd(decode_text(contents[index_path]), data):
                yield f"{name}/{offset:09d}", entry


def _jargon_documents(files: Mapping[str, Path]) -> Iterator[RawDocument]:
    for deb in files.values():
        for _, data in _read_deb(deb, lambda path: path.endswith("/jargon.txt.gz")):
            for number, section in enumerate(split_jargon_file(decode_text(gzip.decompress(data)))):
                yield f"jargon/{number:05d}", section


def _wheel_python_documents(files: Mapping[str, Path]) -> Iterator[RawDocument]:
    for package, wheel in files.items():
        with zipfile.ZipFile(wheel) as archive:
            for name in sorted(archive.namelist()):
                if name.endswith(".py"):
                    yield f"{package}/{name}", archive.read(name)


_GROFF_COMMAND = ("groff", "-K", "utf-8", "-t", "-man", "-Tutf8", "-P-cbou", "-rLL=80n", "-rHY=0")
_MAN_PAGE = re.compile(r"^usr/share/man/(?P<name>man\d/.+)\.gz$")


def _render_man_page(source: bytes) -> bytes:
    result = _run(_GROFF_COMMAND, input=source)
    if result.returncode != 0:
        raise CorpusError(f"groff failed on a man page ({_last_error_line(result.stderr)}); "
                          f"reinstall it with `apt-get install groff-base`")
    return result.stdout


def _man_page_documents(files: Mapping[str, Path]) -> Iterator[RawDocument]:
    """Man pages rendered to plain text with groff (in parallel: it is the slow step); ``.so`` aliases skipped."""
    pages = [(doc_id, source) for doc_id, source in _deb_file_documents(files, _MAN_PAGE)
             if not source.lstrip().startswith(b".so ")]
    with ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:
        rendered = pool.map(_render_man_page, [source for _, source in pages])
        yield from zip([doc_id for doc_id, _ in pages], rendered)


# --------------------------------------------------------------------------------------------------------------
# Domains
# --------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Source:
    """Packages read together by one extractor."""

    packages: tuple[Package, ...]
    extract: Extractor


@dataclass(frozen=True)
class Tool:
    """A system program a domain runs, and the Debian package that provides it."""

    program: str
    debian_package: str


@dataclass(frozen=True)
class Domain:
    """A style of text: the sources its documents come from and the system program it needs, if any."""

    description: str
    sources: tuple[Source, ...]
    tool: Tool | None = None


_FORTUNE_LANGUAGES = {"cs": "GPL-3+", "de": "GPL-2+", "es": "public domain (package GPL-2+)", "it": "public domain",
                      "pl": "GPL-2+", "ru": "GPL-2+", "zh": "GPL-3+"}

_DOMAINS: dict[str, Domain] = {
    "scripture": Domain(
        "King James Bible, one document per chapter",
        (Source((Package("bible-kjv", "GPL-2+ (the program, only run to read the text)"),
                 Package("bible-kjv-text", "public domain")), _kjv_documents),)),
    "dictionary": Domain(
        "GNU Collaborative International Dictionary of English (Webster 1913 + WordNet), one document per entry",
        (Source((Package("dict-gcide", "GPL-2+"),), _dictd_documents),)),
    "quotes": Domain(
        "English fortune cookies, the Jargon File and The Devil's Dictionary",
        (Source((Package("fortunes", "BSD"), Package("fortunes-min", "BSD")), _fortune_documents),
         Source((Package("jargon-text", "public domain"),), _jargon_documents),
         Source((Package("dict-devil", "public domain"),), _dictd_documents))),
    "code": Domain(
        "Python source files of SymPy 1.13.3",
        (Source((Package("sympy", "BSD-3-Clause", pin="1.13.3"),), _wheel_python_documents),)),
    "techdocs": Domain(
        "reStructuredText sources of the Python 3.11 and Linux 6.1 documentation",
        (Source((Package("python3.11-doc", "PSF-2.0"),), partial(
            _deb_file_documents, pattern=re.compile(r"^usr/share/doc/python3\.11/html/_sources/(?P<name>.+)\.txt$"))),
         Source((Package("linux-doc-6.1", "GPL-2.0 (a few media uAPI files GFDL-1.1)"),), partial(
             _deb_file_documents,
             pattern=re.compile(r"^usr/share/doc/linux-doc-6\.1/Documentation/(?P<name>.+\.(?:rst|txt))\.gz$"))))),
    "multilingual": Domain(
        "fortune cookies in Czech, German, Spanish, Italian, Polish, Russian and Chinese",
        (Source(tuple(Package(f"fortunes-{language}", licence) for language, licence in _FORTUNE_LANGUAGES.items()),
                _fortune_documents),)),
    "manpages": Domain(
        "Linux man pages (sections 1-8) rendered to plain text",
        (Source((Package("manpages", "Linux-man-pages-copyleft, GPL-2+, BSD (per page)"),
                 Package("manpages-dev", "Linux-man-pages-copyleft, GPL-2+, BSD (per page)")), _man_page_documents),),
        tool=Tool("groff", "groff-base")),
}

DOMAINS: dict[str, str] = {name: domain.description for name, domain in _DOMAINS.items()}
# Built when no domains are named: the ones that run no system tool beyond apt-get and dpkg-deb.
DEFAULT_DOMAINS: tuple[str, ...] = tuple(name for name, domain in _DOMAINS.items() if domain.tool is None)


# --------------------------------------------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------------------------------------------

def _write_atomically(path: Path, chunks: Iterable[bytes]) -> tuple[int, str]:
    """Write ``chunks`` to ``path`` atomically (``nanotron.files``); return size and sha256."""
    digest, size = hashlib.sha256(), 0

    def write(temporary: Path) -> None:
        nonlocal size
        with open(temporary, "wb") as file:
            for chunk in chunks:
                file.write(chunk)
                digest.update(chunk)
                size += len(chunk)

    atomic_write(path, write)
    return size, digest.hexdigest()


def _jsonl_lines(documents: Iterable[Document]) -> Iterator[bytes]:
    for document in documents:
        yield (json.dumps({"id": document.id, "text": document.text}, ensure_ascii=False) + "\n").encode("utf-8")


def _read_manifest(path: Path) -> dict:
    if not path.exists():
        return {"domains": {}}
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(manifest, dict) or not isinstance(manifest.get("domains"), dict):
            raise ValueError("no 'domains' object")
    except ValueError as error:
        raise CorpusError(f"{path} is not a corpus manifest ({error}); delete it and build again") from error
    return manifest


def _resolve_domains(domains: Sequence[str] | None) -> list[str]:
    names = list(dict.fromkeys(DEFAULT_DOMAINS if domains is None else domains))
    if not names:
        raise CorpusError(f"no corpus domains requested; choose from {', '.join(sorted(DOMAINS))}")
    for name in names:
        if name not in _DOMAINS:
            raise CorpusError(f"unknown corpus domain {name!r}; choose from {', '.join(sorted(DOMAINS))}")
    return names


def _check_tools(names: Sequence[str]) -> None:
    """Fail before any download when a requested domain needs a program this machine lacks."""
    uses_debian = any(package.registry == "debian" for name in names for source in _DOMAINS[name].sources
                      for package in source.packages)
    for program in ("apt-get", "dpkg-deb") if uses_debian else ():
        if shutil.which(program) is None:
            raise CorpusError(f"{program} not found: the corpus is built from Debian packages, so it needs a "
                              f"Debian or Ubuntu machine with apt-get and dpkg-deb")
    for name in names:
        tool = _DOMAINS[name].tool
        if tool is not None and shutil.which(tool.program) is None:
            raise CorpusError(f"corpus domain {name!r} needs {tool.program}, which is not installed; run "
                              f"`apt-get install {tool.debian_package}` or leave {name!r} out")


def _tool_version(tool: Tool) -> str:
    output = _run([tool.program, "--version"]).stdout
    return decode_text(output).splitlines()[0].strip() if output else "unknown"


def _build_domain(name: str, output_dir: Path, cache: _PackageCache, max_mb: float | None) -> dict:
    domain = _DOMAINS[name]
    raw_documents: list[RawDocument] = []
    sources = []
    for source in domain.sources:
        fetched = cache.fetch(source.packages)
        extracted = list(source.extract({item.package.name: item.path for item in fetched}))
        raw_documents += extracted
        versions = ", ".join(f"{item.package.name} {item.version}" for item in fetched)
        _progress(f"{name}: {versions}: {len(extracted):,} raw documents")
        sources += [{"package": item.package.name, "registry": item.package.registry, "version": item.version,
                     "licence": item.package.licence, "file": item.path.name,
                     "sha256": hashlib.sha256(item.path.read_bytes()).hexdigest()} for item in fetched]
    documents = cap_documents(clean_documents(raw_documents), max_mb)
    path = output_dir / f"{name}.jsonl"
    size, sha256 = _write_atomically(path, _jsonl_lines(documents))
    _progress(f"{name}: {len(documents):,} documents, {size / BYTES_PER_MB:.2f} MB -> {path}")
    entry = {"description": domain.description, "file": path.name, "documents": len(documents), "bytes": size,
             "text_bytes": sum(len(document.text.encode("utf-8")) for document in documents), "sha256": sha256,
             "max_mb": max_mb, "sources": sources,
             "build_date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    if domain.tool is not None:
        entry["tool"] = _tool_version(domain.tool)
    return entry


def build_corpus(output_dir: Path, domains: Sequence[str] | None = None, cache_dir: Path | None = None,
                 max_mb_per_domain: float | None = None) -> dict:
    """Build ``<output_dir>/<domain>.jsonl`` for each domain and describe them in ``<output_dir>/manifest.json``.

    Each line is ``{"id": ..., "text": ...}``; documents are sorted by id. ``domains`` defaults to
    ``DEFAULT_DOMAINS``. Downloads are kept in ``cache_dir`` (default ``<output_dir>/.cache``) and reused by later
    builds. ``max_mb_per_domain`` keeps, per domain, the first documents in id order up to that many megabytes of
    text. Domains built earlier into the same folder stay in the manifest. Returns the manifest.
    """
    names = _resolve_domains(domains)
    if max_mb_per_domain is not None and not max_mb_per_domain > 0:
        raise CorpusError(f"max_mb_per_domain must be a positive number of megabytes, got {max_mb_per_domain}")
    _check_tools(names)
    output_dir = Path(output_dir)
    cache_dir = output_dir / ".cache" if cache_dir is None else Path(cache_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    manifest_path = output_dir / MANIFEST_FILE_NAME
    manifest = _read_manifest(manifest_path)
    cache = _PackageCache(cache_dir)
    for name in names:
        manifest["domains"][name] = _build_domain(name, output_dir, cache, max_mb_per_domain)
        manifest["build_date"] = manifest["domains"][name]["build_date"]
        # Rewritten after every domain, so the manifest always describes the JSONL files next to it.
        text = json.dumps(manifest, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
        _write_atomically(manifest_path, [text.encode("utf-8")])
    return manifest


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--domains", nargs="+", default=None, help="default: every domain needing no extra tool")
    parser.add_argument("--cache-dir", type=Path, default=None, help="where downloaded packages are kept")
    parser.add_argument("--max-mb-per-domain", type=float, default=None)
    args = parser.parse_args(argv)
    try:
        manifest = build_corpus(args.output_dir, args.domains, args.cache_dir, args.max_mb_per_domain)
    except CorpusError as error:
        # The message names the domain, file or tool and the fix: one line, no traceback.
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {len(manifest['domains'])} domains to {args.output_dir}")


if __name__ == "__main__":
    main()
