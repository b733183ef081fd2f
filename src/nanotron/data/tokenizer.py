"""Loading, training and identifying Hugging Face ``tokenizers`` tokenizers.

A preprocessed folder stores token ids, which only mean something together with the tokenizer that produced
them. ``tokenizer_fingerprint`` gives that tokenizer a stable identity, recorded in every folder, so a blend of
folders or a model can be checked against it instead of silently training on mismatched ids. ``TokenizerIdentity``
compares tokenizers known by a name only (datatrove records one) by the same fingerprint, wherever their files are on
this machine.
"""

import dataclasses
import hashlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm

from nanotron.data.documents import iter_documents, list_input_files
from nanotron.files import atomic_write

TOKENIZER_FILE_NAME = "tokenizer.json"
EOS_TOKEN = "<|endoftext|>"
# End-of-document tokens of common tokenizer families (GPT-2/NeoX, Llama 2/Mistral, Llama 3 base, Gemma,
# Llama 3 chat), in order of preference.
EOS_TOKEN_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>")
# A byte-level BPE vocabulary always holds the 256 byte symbols and the end-of-document token.
MIN_VOCAB_SIZE = 256 + 1


class TokenizerError(ValueError):
    """A tokenizer could not be loaded, trained or used as asked."""


def load_tokenizer(name_or_path: str | Path, revision: str | None = None) -> Tokenizer:
    """Load a tokenizer from a ``tokenizer.json`` file, a directory holding one, or a Hugging Face Hub name.

    Local paths win over hub names, so an existing folder called like a hub repository is used as is.
    """
    path = Path(name_or_path)
    if path.is_dir():
        path = path / TOKENIZER_FILE_NAME
        if not path.is_file():
            raise TokenizerError(f"tokenizer directory {name_or_path} has no {TOKENIZER_FILE_NAME}; "
                                 f"pass the tokenizer file itself or a directory that contains one")
    if path.is_file():
        try:
            return Tokenizer.from_file(str(path))
        except Exception as error:
            raise TokenizerError(f"{path} is not a valid Hugging Face tokenizer file ({error}); "
                                 f"create one with `nanotron train-tokenizer`") from error
    if path.suffix == ".json":
        raise TokenizerError(f"tokenizer file {name_or_path} does not exist; check the path")
    try:
        return Tokenizer.from_pretrained(str(name_or_path), revision=revision or "main")
    except Exception as error:
        raise TokenizerError(f"tokenizer {name_or_path!r} does not exist locally and could not be loaded from the "
                             f"Hugging Face Hub ({type(error).__name__}); pass a local tokenizer.json or check "
                             f"the name and your connection") from error


def tokenizer_file(output: Path) -> Path:
    """The file ``train_tokenizer`` writes for ``output``: a ``.json`` path itself, else ``tokenizer.json`` in that
    folder."""
    output = Path(output)
    return output if output.suffix == ".json" else output / TOKENIZER_FILE_NAME


def train_tokenizer(inputs: Sequence[Path], vocab_size: int, output: Path, text_key: str = "text",
                    min_frequency: int = 2) -> Path:
    """Train a byte-level BPE tokenizer on the documents of ``inputs`` and write it as ``tokenizer.json``.

    ``inputs`` are files or directories in the formats ``nanotron preprocess`` reads. ``output`` is a ``.json``
    file path or a directory (the file is then ``<output>/tokenizer.json``). Training is deterministic: the same
    inputs give a byte-identical file. Byte-level BPE can encode any text without unknown tokens, and
    ``<|endoftext|>`` (id 0) is the end-of-document token that preprocessing appends.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise TokenizerError(f"--vocab-size must be at least {MIN_VOCAB_SIZE} (256 byte symbols plus "
                             f"{EOS_TOKEN}), got {vocab_size}")
    if min_frequency < 1:
        raise TokenizerError(f"min_frequency must be at least 1, got {min_frequency}")
    files = list_input_files(inputs)
    output_file = tokenizer_file(output)
    if output_file.is_dir():
        raise TokenizerError(f"tokenizer output {output_file} is a directory; pass a .json file path or a "
                             f"directory to write {TOKENIZER_FILE_NAME} into")

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)

    def documents() -> Iterator[str]:
        for file in tqdm(files, desc="training tokenizer", unit="file"):
            yield from iter_documents(file, text_key)

    tokenizer.train_from_iterator(documents(), trainer=trainer)

    atomic_write(output_file, lambda temporary: tokenizer.save(str(temporary)))  # never a half-written tokenizer
    return output_file


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """The sha256 (hex) of the tokenizer's canonical JSON: equal fingerprints mean identical token ids."""
    return hashlib.sha256(tokenizer.to_str().encode("utf-8")).hexdigest()


def eos_token_id(tokenizer: Tokenizer) -> int:
    """The id of the end-of-document token, the first of ``EOS_TOKEN_CANDIDATES`` in the vocabulary."""
    token_id = _end_of_document_id(tokenizer)
    if token_id is None:
        raise TokenizerError(f"the tokenizer has none of the end-of-document tokens "
                             f"{', '.join(EOS_TOKEN_CANDIDATES)}; use a tokenizer that defines one (e.g. train one "
                             f"with `nanotron train-tokenizer`)")
    return token_id


def _end_of_document_id(tokenizer: Tokenizer) -> int | None:
    ids = (tokenizer.token_to_id(token) for token in EOS_TOKEN_CANDIDATES)
    return next((token_id for token_id in ids if token_id is not None), None)


def _prepended_id(tokenizer: Tokenizer) -> int | None:
    """The special token the tokenizer's post-processor puts before every text (Llama's ``<s>``), None if none."""
    encoding = tokenizer.encode("a")
    return encoding.ids[0] if encoding.special_tokens_mask[0] else None


def _is_special(tokenizer: Tokenizer, token_id: int | None) -> bool:
    token = tokenizer.get_added_tokens_decoder().get(token_id)
    return token is not None and token.special


def describe_token(tokenizer: Tokenizer, token_id: int | None) -> str:
    """``token_id`` and its text, for messages (``null`` for None)."""
    return "null" if token_id is None else f"{token_id} ({tokenizer.id_to_token(token_id)!r})"


def model_token_ids(tokenizer: Tokenizer, model_config) -> tuple[dict[str, int | None], list[str]]:
    """``model_config``'s ``bos_token_id`` and ``eos_token_id`` as a model of ``tokenizer`` has them, and the names of
    those that named an ordinary token of it.

    The tokenizer's own ids are the token its post-processor puts before every text (None: none) and its
    end-of-document token, which ``nanotron preprocess`` appends to every document. An id that names one of the
    tokenizer's special tokens is kept (a chat model's end of turn, a converted model's own), and so is None; one
    left at the config class's default becomes the tokenizer's own (the defaults 1 and 2 are ``!`` and ``"`` of a
    byte-level BPE); any other is replaced by the tokenizer's own too, and named.
    """
    own = {"bos_token_id": _prepended_id(tokenizer), "eos_token_id": _end_of_document_id(tokenizer)}
    defaults = {field.name: field.default for field in dataclasses.fields(model_config)}
    ids, ordinary = {}, []
    for name, theirs in own.items():
        value = getattr(model_config, name)
        kept = value is None or value == theirs or _is_special(tokenizer, value)
        ids[name] = value if kept else theirs
        if not kept and value != defaults[name]:
            ordinary.append(name)
    return ids, ordinary


def local_tokenizer_file(name_or_path: str | Path, revision: str | None = None) -> Path | None:
    """The ``tokenizer.json`` that ``name_or_path`` leads to on this machine, found without the network: the file
    itself, the one inside a folder, or a Hugging Face Hub name's copy in the local cache (at ``revision``, default
    main); None where there is none."""
    path = Path(name_or_path)
    if path.is_dir():
        path = path / TOKENIZER_FILE_NAME
    if path.is_file():
        return path
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(str(name_or_path), TOKENIZER_FILE_NAME, revision=revision)
    except (ImportError, ValueError):  # no hub client, or not a Hub name (a path that does not exist here)
        return None
    return Path(cached) if isinstance(cached, str) else None


@dataclass(frozen=True)
class TokenizerIdentity:
    """A tokenizer as data and config name it: ``name`` as written (None where nothing names it) and the
    ``fingerprint`` of its ``tokenizer.json`` (None where its files are not on this machine).

    Two tokenizers are the same when their files have the same content once loaded, however they are named: a folder
    and the ``tokenizer.json`` inside it, a Hub name and its copy in the local cache. Where one content is unknown,
    their names are compared instead (``same_as``).
    """

    name: str | None
    fingerprint: str | None = None

    @classmethod
    def find(cls, name_or_path: str, revision: str | None = None) -> "TokenizerIdentity":
        """``name_or_path`` with the fingerprint of the file it leads to here (``local_tokenizer_file``), if any."""
        file = local_tokenizer_file(name_or_path, revision)
        try:
            fingerprint = None if file is None else tokenizer_fingerprint(Tokenizer.from_file(str(file)))
        except Exception:  # not a tokenizer file: its content is unknown
            fingerprint = None
        return cls(str(name_or_path), fingerprint)

    def same_as(self, other: "TokenizerIdentity") -> bool | None:
        """By content where both fingerprints are known; otherwise True where the names agree (a path to a
        ``tokenizer.json`` standing for its folder), None (unknown) where they do not."""
        if self.fingerprint is not None and other.fingerprint is not None:
            return self.fingerprint == other.fingerprint
        if self.name is not None and other.name is not None and _normalised(self.name) == _normalised(other.name):
            return True
        return None

    def __str__(self) -> str:
        if self.name is not None:
            return self.name
        return f"the tokenizer of fingerprint {self.fingerprint[:12]}" if self.fingerprint else "an unnamed tokenizer"


def _normalised(name: str) -> str:
    """A tokenizer's name as compared without its files: a path absolute and standing for its folder, a Hub name as
    written."""
    path = Path(os.path.normpath(os.path.expanduser(name)))
    if path.name == TOKENIZER_FILE_NAME:
        path = path.parent
    return str(path.resolve()) if path.exists() else str(path)
