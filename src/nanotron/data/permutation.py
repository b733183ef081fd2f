"""A keyed pseudo-random permutation of ``[0, n)`` evaluated one index at a time.

Shuffling a dataset with ``np.random.permutation(n)`` needs O(n) memory and, to resume at sample ``g``, either
the whole array or a replay of everything before ``g``. A keyed bijection avoids both: position ``i`` of the
shuffled order is ``permute(i, n, seed, stream)``, computed in O(1), so any sample of any epoch can be looked up
directly and resuming costs nothing.

The bijection is a balanced Feistel network on the smallest ``2**(2*h) >= n``. Feistel networks are
permutations for any round function, which we take from the splitmix64 finaliser keyed by ``(seed, stream,
round)``. Values that land outside ``[0, n)`` are fed through the network again ("cycle walking"); because
the domain is less than ``4 * n``, this takes fewer than four passes on average and stays a bijection of
``[0, n)``.
"""

import numpy as np

_MASK64 = (1 << 64) - 1
_NUM_ROUNDS = 6


def _splitmix64(x: int) -> int:
    """The splitmix64 step on Python ints: a well-mixed 64-bit hash used to derive the round keys."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _mix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser on uint64 arrays (multiplications wrap modulo 2**64 as intended)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _round_keys(seed: int, stream: int) -> list[np.uint64]:
    state = _splitmix64(_splitmix64(seed & _MASK64) ^ (stream & _MASK64))
    return [np.uint64(_splitmix64(state ^ round_index)) for round_index in range(_NUM_ROUNDS)]


def _feistel(x: np.ndarray, half_bits: int, keys: list[np.uint64]) -> np.ndarray:
    """One pass of the Feistel network over ``[0, 2**(2*half_bits))``; a bijection of that range."""
    shift = np.uint64(half_bits)
    mask = np.uint64((1 << half_bits) - 1)
    left, right = x >> shift, x & mask
    for key in keys:
        left, right = right, left ^ (_mix64(right ^ key) & mask)
    return (left << shift) | right


def permute(indices: np.ndarray | int, n: int, seed: int, stream: int) -> np.ndarray | int:
    """Return the positions of ``indices`` under the permutation of ``[0, n)`` keyed by ``(seed, stream)``.

    ``indices`` is an int or an integer array with values in ``[0, n)``; the result has the same type and shape
    (int64 for arrays). The same ``(n, seed, stream)`` always gives the same permutation, on every machine.
    """
    if n < 1:
        raise ValueError(f"permute needs n >= 1, got n={n}")
    values = np.asarray(indices, dtype=np.int64)
    if values.size and (values.min() < 0 or values.max() >= n):
        raise ValueError(f"permute indices must lie in [0, {n}), got values in [{values.min()}, {values.max()}]")

    half_bits = max(1, ((n - 1).bit_length() + 1) // 2)
    keys = _round_keys(seed, stream)
    flat = values.reshape(-1).astype(np.uint64)
    outside = np.ones(flat.shape, dtype=bool)
    while outside.any():
        flat[outside] = _feistel(flat[outside], half_bits, keys)
        outside = flat >= np.uint64(n)
    result = flat.astype(np.int64).reshape(values.shape)
    return int(result) if isinstance(indices, (int, np.integer)) else result
