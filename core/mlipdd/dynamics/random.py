"""Counter-based random numbers keyed by (seed, stream, step, atom id).

# NOTE [noise that does not depend on the split]
Langevin noise and initial velocities must not change when the atoms are split across
ranks, reordered, or migrated. A stateful generator cannot promise that: the numbers an
atom gets would depend on how many atoms came before it on its rank. Instead every
number is a pure function of ``(seed, stream, step, atom_id, k)``: a 32-bit integer hash
of those words, turned into a normal by Box-Muller. Any rank that owns an atom draws
exactly the numbers every other layout would have drawn for it, and the same numbers
come out on CPU and GPU.

The hash works on 32-bit words stored in int64 tensors and never lets a product
exceed 2**63, so no step relies on signed overflow (undefined in C++ and therefore in
torch kernels).
"""

from __future__ import annotations

import math

import torch

_MASK32 = 0xFFFFFFFF

# Named streams keep independent uses of one seed apart.
STREAM_LANGEVIN = 1
STREAM_INITIAL_VELOCITIES = 2


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32), without overflowing int64."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A well-tested 32-bit finaliser (xor-shift-multiply, "lowbias32" constants)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _words(value: int) -> tuple[int, int]:
    value &= (1 << 64) - 1
    return value & _MASK32, value >> 32


def hash_uniform(seed: int, stream: int, step: int, atom_ids: torch.Tensor, n: int) -> torch.Tensor:
    """Uniform numbers in (0, 1), shape (len(atom_ids), n), float64.

    Column ``k`` of row ``i`` depends only on (seed, stream, step, atom_ids[i], k).
    """
    ids = atom_ids.to(torch.int64).reshape(-1, 1)
    k = torch.arange(n, dtype=torch.int64, device=ids.device).reshape(1, -1)
    h = torch.full((1, 1), 0x9E3779B9, dtype=torch.int64, device=ids.device)
    # Absorb the scalar words first (same for every atom), then the per-atom words.
    for word in (*_words(seed), stream & _MASK32, *_words(step)):
        h = _mix32((h ^ word) & _MASK32)
    h = _mix32(h ^ (ids & _MASK32))
    h = _mix32(h ^ ((ids >> 32) & _MASK32))
    h = _mix32(h ^ k)
    h = _mix32(h ^ 0x68E31DA4)  # one more round: k only entered in the last mix
    return (h.to(torch.float64) + 0.5) * (1.0 / 4294967296.0)


def hash_normal(
    seed: int, stream: int, step: int, atom_ids: torch.Tensor, n: int = 3
) -> torch.Tensor:
    """Standard normals, shape (len(atom_ids), n), float64 (Box-Muller on hashed uniforms)."""
    u = hash_uniform(seed, stream, step, atom_ids, 2 * n)
    radius = torch.sqrt(-2.0 * torch.log(u[:, :n]))
    return radius * torch.cos((2.0 * math.pi) * u[:, n:])
