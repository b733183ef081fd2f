"""Tests of the demo corpus builder ``scripts/build_corpus.py``: the cleaning and parsing functions on synthetic
inputs, an offline build from a cached wheel, its command line, and (with NANOTRON_TEST_NETWORK=1) a real build of the
``quotes`` domain from Debian."""

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import build_corpus as corpus
import pytest

SCRIPT = Path(corpus.__file__)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


# ---- clean_text ---------------------------------------------------------------------------------------------------

def test_clean_text_strips_ansi_escapes():
    assert corpus.clean_text("\x1b[1;31mred\x1b[0m and \x1b]0;title\x07plain") == "red and plain"


def test_clean_text_removes_backspace_overstrikes():
    # nroff bold ("B\bB") and underline ("_\bu") leave the plain letters.
    assert corpus.clean_text("B\bBo\bol\bld\bd _\bu_\bn_\bd_\be_\br") == "Bold under"


def test_clean_text_drops_control_characters_but_keeps_tabs():
    assert corpus.clean_text("a\x00b\x07c\x0bd\te\x0cf") == "abcd\tef"


def test_clean_text_normalises_line_endings_and_nfc():
    assert corpus.clean_text("cafe\u0301\r\nline two\rthree") == "caf\u00e9\nline two\nthree"


def test_clean_text_squeezes_blank_lines_and_trailing_whitespace():
    raw = "\n\n  indented first   \n\n\n\n\nsecond\t \n \n\n"
    assert corpus.clean_text(raw) == "  indented first\n\nsecond"


def test_decoding_falls_back_to_latin1():
    assert corpus.clean_text("café".encode()) == "café"
    assert corpus.clean_text("café".encode("latin-1")) == "café"
    assert corpus.decode_text(b"\xff\xfe") == "\u00ff\u00fe"


# ---- documents ----------------------------------------------------------------------------------------------------

def test_clean_documents_drops_short_dedupes_and_sorts():
    documents = corpus.clean_documents([
        ("b/2", "the same text, long enough"),
        ("c/1", "short"),
        ("a/9", "the same text, long enough  \n"),  # equal once cleaned; the smaller id wins
        ("a/1", b"bytes are decoded and cleaned\r\n"),
    ])
    assert documents == [corpus.Document("a/1", "bytes are decoded and cleaned"),
                         corpus.Document("a/9", "the same text, long enough")]


def test_clean_documents_rejects_duplicate_ids():
    with pytest.raises(ValueError, match="duplicate document id 'x'"):
        corpus.clean_documents([("x", "first text that is long"), ("x", "second text that is long")])


def test_cap_documents_keeps_the_first_documents_within_the_budget():
    documents = [corpus.Document(f"{i}", "é" * 250_000) for i in range(5)]  # 0.5 MB of UTF-8 each
    assert [d.id for d in corpus.cap_documents(documents, 1.2)] == ["0", "1"]
    assert corpus.cap_documents(documents, None) == documents
    assert corpus.cap_documents(documents, 0.1) == []


# ---- parsers ------------------------------------------------------------------------------------------------------

def test_split_fortunes():
    text = "%\nFirst fortune.\n%\nSecond,\n  on two lines.\n%\n\n%\nLast one\r\n%"
    assert corpus.split_fortunes(text) == ["First fortune.", "Second,\n  on two lines.", "Last one"]


def test_split_fortunes_keeps_percent_signs_inside_entries():
    assert corpus.split_fortunes("100% sure\n%\n50 %\n") == ["100% sure", "50 %"]


def dictd_number(value: int) -> str:
    """Encode like dictfmt: base 64, most significant digit first."""
    digits = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    code = digits[value % 64]
    while value >= 64:
        value //= 64
        code = digits[value % 64] + code
    return code


def test_decode_dictd_number():
    decode = corpus.decode_dictd_number
    assert [decode(code) for code in ("A", "B", "/", "BA", "5I")] == [0, 1, 63, 64, 57 * 64 + 8]
    assert all(decode(dictd_number(value)) == value for value in (0, 5, 64, 4095, 4096, 123_456_789))
    with pytest.raises(ValueError, match="not a dictd"):
        corpus.decode_dictd_number("A-B")


def test_slice_dictd_dedupes_spans_and_skips_metadata():
    padding = b"x" * 70  # pushes offsets past 64, so they need two base-64 digits
    metadata = b"00-database-short\n   A tiny test dictionary\n"
    apple = b"Apple \\Ap\"ple\\, n.\n   A fruit.\n"
    banana = b"Banana \\Ba*nan\"a\\, n.\n   A yellow fruit.\n"
    data = padding + metadata + apple + banana
    offsets = {"metadata": 70, "apple": 70 + len(metadata), "banana": 70 + len(metadata) + len(apple)}

    def line(headword: str, offset: int, length: int) -> str:
        return f"{headword}\t{dictd_number(offset)}\t{dictd_number(length)}"

    index = "\n".join([
        line("00-database-short", offsets["metadata"], len(metadata)),
        line("00-gcide-short", offsets["metadata"], len(metadata)),  # an alias of the metadata: skipped too
        line("apple", offsets["apple"], len(apple)),
        line("banana", offsets["banana"], len(banana)),
        line("Apple", offsets["apple"], len(apple)),  # a second headword for the same definition
    ]) + "\n"
    assert corpus.slice_dictd(index, data) == [(offsets["apple"], apple), (offsets["banana"], banana)]


def test_slice_dictd_rejects_malformed_lines():
    with pytest.raises(ValueError, match="3 tab-separated fields"):
        corpus.slice_dictd("apple A\n", b"")


KJV_DUMP = """
Genesis 1

  1 In the beginning God created the heaven and the earth.
  2 And the earth was without form, and void.

Genesis 2

  1 Thus the heavens and the earth were finished.

1 Samuel 1

  10 And she was in bitterness of soul.

Song of Solomon 8

  14 Make haste, my beloved.
"""


def test_group_kjv_chapters():
    chapters = corpus.group_kjv_chapters(KJV_DUMP)
    assert [chapter.id for chapter in chapters] == ["kjv/01-genesis/001", "kjv/01-genesis/002",
                                                    "kjv/02-1-samuel/001", "kjv/03-song-of-solomon/008"]
    assert chapters[0].text == ("Genesis 1\n\nIn the beginning God created the heaven and the earth.\n"
                                "And the earth was without form, and void.")
    assert chapters[2].text == "1 Samuel 1\n\nAnd she was in bitterness of soul."


def test_group_kjv_chapters_rejects_text_before_the_first_heading():
    with pytest.raises(ValueError, match="instead of a chapter heading"):
        corpus.group_kjv_chapters("  1 A verse without a chapter\n")


def test_split_jargon_file_keeps_prose_and_drops_listings():
    nbsp = "\u00a0"
    text = "\n".join([
        "                                The Jargon File",
        "   Table of Contents",
        "   Welcome to the Jargon File",  # a table-of-contents line, not the preface title
        "                          Welcome to the Jargon File",
        "   This is the Jargon File.",
        f"                             Part{nbsp}I.{nbsp}Introduction",
        "   1. Hacker Slang",
        f"Chapter{nbsp}1.{nbsp}Hacker Slang and Hacker Culture",
        "   This document is a collection.",
        "Glossary",
        "   abbrev",
        "  A",
        "   abbrev",
        "   :abbrev: /*-bree'v/, n.",
        "   Common abbreviation for ‘abbreviation’.",
        "  B",
        "   :bang: n.",
        "   Common spoken name for ‘!’.",
        f"Appendix{nbsp}A.{nbsp}Hacker Folklore",
        "   Some stories.",
    ])
    sections = corpus.split_jargon_file(text)
    assert [section.splitlines()[0].strip() for section in sections] == [
        "Welcome to the Jargon File", f"Chapter{nbsp}1.{nbsp}Hacker Slang and Hacker Culture",
        ":abbrev: /*-bree'v/, n.", ":bang: n.", f"Appendix{nbsp}A.{nbsp}Hacker Folklore"]
    assert sections[2] == "   :abbrev: /*-bree'v/, n.\n   Common abbreviation for ‘abbreviation’."


# ---- build_corpus without the network -----------------------------------------------------------------------------

def test_domain_names_and_defaults():
    assert set(corpus.DOMAINS) == {"scripture", "dictionary", "quotes", "code", "techdocs", "multilingual",
                                   "manpages"}
    assert set(corpus.DEFAULT_DOMAINS) == set(corpus.DOMAINS) - {"manpages"}


def test_unknown_domain_is_an_error_listing_the_valid_ones(tmp_path):
    output = tmp_path / "corpus"
    with pytest.raises(corpus.CorpusError,
                       match="unknown corpus domain 'poetry'; choose from code, dictionary, manpages"):
        corpus.build_corpus(output, ["quotes", "poetry"])
    assert not output.exists()


def test_non_positive_cap_is_an_error(tmp_path):
    with pytest.raises(corpus.CorpusError, match="max_mb_per_domain must be a positive"):
        corpus.build_corpus(tmp_path, ["quotes"], max_mb_per_domain=0)


def test_missing_groff_is_an_error_naming_the_package(tmp_path, monkeypatch):
    real_which = corpus.shutil.which
    monkeypatch.setattr(corpus.shutil, "which", lambda name: None if name == "groff" else real_which(name))
    with pytest.raises(corpus.CorpusError, match=r"'manpages' needs groff.*apt-get install groff-base"):
        corpus.build_corpus(tmp_path, ["manpages"])


@pytest.fixture
def demo_domain(tmp_path, monkeypatch) -> Path:
    """A 'demo' domain read from a wheel already in the cache, so the build needs no network."""
    cache = tmp_path / "cache"
    (cache / "pypi").mkdir(parents=True)
    with zipfile.ZipFile(cache / "pypi" / "demo-1.0-py3-none-any.whl", "w") as wheel:
        wheel.writestr("demo/b.py", "def b():\r\n    return 'b'   \n\n\n\n")
        wheel.writestr("demo/a.py", "def a():\n    return 'a'\n")
        wheel.writestr("demo/__init__.py", "")
        wheel.writestr("demo/copy.py", "def a():\n    return 'a'\n")
        wheel.writestr("demo/data.txt", "not python, not read")
    domain = corpus.Domain("a demo package", (corpus.Source(
        (corpus.Package("demo", "MIT", pin="1.0"),), corpus._wheel_python_documents),))
    monkeypatch.setitem(corpus._DOMAINS, "demo", domain)
    return cache


def test_offline_build_writes_sorted_jsonl_and_manifest(tmp_path, demo_domain):
    output = tmp_path / "corpus"
    manifest = corpus.build_corpus(output, ["demo"], cache_dir=demo_domain)

    assert read_jsonl(output / "demo.jsonl") == [
        {"id": "demo/demo/a.py", "text": "def a():\n    return 'a'"},
        {"id": "demo/demo/b.py", "text": "def b():\n    return 'b'"},
    ]
    assert json.loads((output / "manifest.json").read_text()) == manifest
    entry = manifest["domains"]["demo"]
    jsonl = (output / "demo.jsonl").read_bytes()
    assert entry["documents"] == 2
    assert entry["bytes"] == len(jsonl)
    assert entry["sha256"] == hashlib.sha256(jsonl).hexdigest()
    assert entry["text_bytes"] == 46
    assert entry["sources"] == [{
        "package": "demo", "registry": "pypi", "version": "1.0", "licence": "MIT",
        "file": "demo-1.0-py3-none-any.whl",
        "sha256": hashlib.sha256((demo_domain / "pypi" / "demo-1.0-py3-none-any.whl").read_bytes()).hexdigest()}]
    assert manifest["build_date"] == entry["build_date"]
    assert sorted(path.name for path in output.iterdir()) == ["demo.jsonl", "manifest.json"]


def test_rebuild_is_byte_identical_and_keeps_other_domains(tmp_path, demo_domain):
    output = tmp_path / "corpus"
    first = corpus.build_corpus(output, ["demo"], cache_dir=demo_domain)["domains"]["demo"]["sha256"]
    manifest = json.loads((output / "manifest.json").read_text())
    manifest["domains"]["earlier"] = {"file": "earlier.jsonl"}
    (output / "manifest.json").write_text(json.dumps(manifest))

    capped = corpus.build_corpus(output, ["demo"], cache_dir=demo_domain, max_mb_per_domain=30e-6)
    assert capped["domains"]["earlier"] == {"file": "earlier.jsonl"}
    assert capped["domains"]["demo"]["documents"] == 1
    assert capped["domains"]["demo"]["max_mb"] == 30e-6
    assert corpus.build_corpus(output, ["demo"], cache_dir=demo_domain)["domains"]["demo"]["sha256"] == first


def test_corrupt_manifest_is_an_error_naming_the_file(tmp_path, demo_domain):
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(corpus.CorpusError, match=r"manifest.json is not a corpus manifest .*delete it"):
        corpus.build_corpus(tmp_path, ["demo"], cache_dir=demo_domain)
    assert not (tmp_path / "demo.jsonl").exists()


# ---- the script's command line -----------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_builder_is_a_script_not_part_of_the_library():
    assert importlib.util.find_spec("nanotron.data.corpus") is None
    listed = subprocess.run([sys.executable, "-m", "nanotron", "--help"], capture_output=True, text=True, timeout=300)
    assert listed.returncode == 0 and "build-corpus" not in listed.stdout


def test_main_builds_and_reports_the_folder(tmp_path, demo_domain, capsys):
    output = tmp_path / "corpus"
    corpus.main(["--output-dir", str(output), "--domains", "demo", "--cache-dir", str(demo_domain),
                 "--max-mb-per-domain", "1"])
    assert capsys.readouterr().out == f"wrote 1 domains to {output}\n"
    assert json.loads((output / "manifest.json").read_text())["domains"]["demo"]["max_mb"] == 1.0


def test_bad_input_is_one_error_line_with_status_2(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPT), "--output-dir", str(tmp_path / "c"), "--domains", "poetry"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith("error: unknown corpus domain 'poetry'") and "scripture" in result.stderr
    assert len(result.stderr.splitlines()) == 1 and not (tmp_path / "c").exists()


# ---- a real build -------------------------------------------------------------------------------------------------

@pytest.mark.skipif(os.environ.get("NANOTRON_TEST_NETWORK") != "1",
                    reason="downloads Debian packages; set NANOTRON_TEST_NETWORK=1 to run it")
def test_build_quotes_from_debian(tmp_path):
    manifest = corpus.build_corpus(tmp_path, ["quotes"])

    entry = manifest["domains"]["quotes"]
    assert [source["package"] for source in entry["sources"]] == ["fortunes", "fortunes-min", "jargon-text",
                                                                  "dict-devil"]
    assert all(source["version"] and source["file"].endswith(".deb") for source in entry["sources"])
    documents = read_jsonl(tmp_path / "quotes.jsonl")
    assert entry["documents"] == len(documents) > 10_000
    assert 3_000_000 < entry["text_bytes"] < entry["bytes"] < 10_000_000
    assert entry["sha256"] == hashlib.sha256((tmp_path / "quotes.jsonl").read_bytes()).hexdigest()
    ids = [document["id"] for document in documents]
    assert ids == sorted(set(ids))
    assert all(set(document) == {"id", "text"} and len(document["text"]) >= 20 for document in documents)
    assert {document_id.split("/")[0] for document_id in ids} == {"devil", "fortunes", "fortunes-min", "jargon"}
    jargon = next(document["text"] for document in documents if document["text"].startswith("   :hacker: "))
    assert "A person who enjoys exploring the details of programmable systems" in jargon
