"""The id check of datatrove folders, shared by the ranks of a run: datatrove records no id range, so the check
reads the data, and each rank reads its own share of every file, once per run instead of once per rank. A bad id
found by any rank stops every rank with the same message, naming the file and the token."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import numpy as np

from support.distributed import run_distributed

VOCAB, TOKENS, BAD_AT = 384, 5000, 3777  # the bad id in the second half of the file: rank 1's share


def _open_on_every_rank(folder: Path) -> tuple[list[tuple[int, int]], str | None]:
    """Opens the folder as a trainer does (its row of ``data/sources.py``); returns the (first token, tokens) this
    rank checked and the error it raised."""
    from nanotron.checkpoint.manager import first_problem
    from nanotron.config import DatasetArgs
    from nanotron.data import datatrove_folder
    from nanotron.data.dataset import DataError
    from nanotron.data.sources import Ranks, SourceContext, build_source
    from nanotron.layout import Layout
    from nanotron.parallel.context import ParallelContext

    pc = ParallelContext(Layout(dp=2))
    checked, check = [], datatrove_folder.check_token_ids

    def recording(path, tokens, *args, first=0, **kwargs):
        checked.append((first, len(tokens)))
        return check(path, tokens, *args, first=first, **kwargs)

    with mock.patch.object(datatrove_folder, "check_token_ids", recording):
        try:
            build_source(DatasetArgs(dataset_folder=[folder]),
                         SourceContext(64, 0, VOCAB, Ranks(pc.rank, pc.world_size, first_problem)))
        except DataError as error:
            return checked, str(error)
    return checked, None


def test_each_rank_checks_its_share_of_the_ids_and_every_rank_stops_on_a_bad_one(tmp_path):
    good, bad = tmp_path / "good", tmp_path / "bad"
    tokens = np.random.default_rng(0).integers(0, VOCAB, TOKENS, dtype=np.uint16)
    for folder in (good, bad):
        folder.mkdir()
    tokens.tofile(good / "part.ds")
    tokens[BAD_AT] = VOCAB + 16
    tokens.tofile(bad / "part.ds")

    (checked_0, error_0), (checked_1, error_1) = run_distributed(_open_on_every_rank, 2, folder=good)
    assert checked_0 == [(0, TOKENS // 2)] and checked_1 == [(TOKENS // 2, TOKENS - TOKENS // 2)]
    assert error_0 is None and error_1 is None

    (_, error_0), (_, error_1) = run_distributed(_open_on_every_rank, 2, folder=bad)
    assert error_0 == error_1  # rank 0 read no bad id, yet stops with rank 1's message
    assert f"file {bad / 'part.ds'} holds token id {VOCAB + 16} at token {BAD_AT}," in error_0
