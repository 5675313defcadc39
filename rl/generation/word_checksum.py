"""A per-tensor checksum computed where a bucket lives (a CUDA buffer on the NCCL path), so that verifying a
push never copies the bytes to the host.

XXH3 (`transfer_base.checksum`) runs on host memory only: on a GPU every bucket would first cross PCIe to be
hashed by one CPU core, on the sender and again on every engine worker (for the 32-node recipe 53 GB per
GPU each way, seconds per push). This is a plain integer reduction that torch runs on any device, so the
sender and the receivers compute it with the same ops on their own buffers.

For a tensor at byte `offset` (a multiple of 4) of `nbytes` in a bucket, with w_j the bucket's j-th 4-byte
word read as a signed int32 and u_b its b-th byte:

    S = sum_{j in [offset/4, (offset+nbytes)//4)} w_j * k(j)  +  sum_{b in the last nbytes % 4 bytes} u_b * k(2^40 + b)
    k(i) = (2 i + 1) * 0x9E3779B97F4A7C15                                      all mod 2^64

Every weight is odd, so any change of one word (|delta| < 2^32) changes S: a single corrupted word is always
caught; words swapped or shifted move S by a product of position-dependent weights. Like XXH3 it detects
corruption in transit, not a forger. Sums mod 2^64 are independent of the order of the additions, so a
device's parallel reduction gives the same value as the CPU's (gpu_check.py compares them on a GPU).
"""

from __future__ import annotations

KIND = "wordsum64"  # the name a bucket's records carry (`hash`), beside transfer_base's "xxh3"
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # as a signed int64: torch multiplies int64 with wrap-around
_TAIL = 1 << 40  # tail bytes get weights of their own, never a word's
CHUNK_WORDS = 1 << 24  # 64 MB of payload per pass: bounds the int64 temporaries (~4 x 128 MB)


def _weighted(values, first_index: int):
    """values (int64) * k(first_index + i), elementwise, mod 2^64 (in place: `values` is a temporary)."""
    import torch

    odd = torch.arange(2 * first_index + 1, 2 * (first_index + values.numel()) + 1, 2, dtype=torch.int64,
                       device=values.device)
    return values.mul_(odd.mul_(_GOLDEN))


def word_checksums(payload, spans, chunk_words: int = CHUNK_WORDS) -> list[int]:
    """S (above) of each (offset, nbytes) span of `payload` (a 1-D uint8 torch tensor on any device), as
    ints in [0, 2^64). One pass over the words the spans cover, chunk by chunk, whatever their number:
    prefix sums of the weighted words, read at each span's first and last word."""
    import torch

    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise ValueError(f"payload: expected a 1-D uint8 tensor, got {payload.dtype} of shape {tuple(payload.shape)}")
    spans = [(int(o), int(n)) for o, n in spans]
    for o, n in spans:
        if o % 4 or o < 0 or n < 0 or o + n > payload.numel():
            raise ValueError(f"span (offset {o}, {n} bytes) of a {payload.numel()}-byte payload: expected a "
                             "4-byte aligned offset inside it")
    if not spans:
        return []
    n_words = max(o + n for o, n in spans) // 4
    words = payload[:n_words * 4].view(torch.int32)
    bounds = sorted({b for o, n in spans for b in (o // 4, (o + n) // 4)})
    prefix = {0: 0}  # P(i) = sum of the weighted words [0, i), mod 2^64 (as a signed int64)
    carry = torch.zeros((), dtype=torch.int64, device=payload.device)
    for start in range(0, n_words, chunk_words):
        stop = min(start + chunk_words, n_words)
        wanted = [b for b in bounds if start < b <= stop]
        weighted = _weighted(words[start:stop].to(torch.int64), start)
        if not wanted:  # a chunk inside one span: only its sum is carried on
            carry = carry + weighted.sum()
            continue
        weighted[0] += carry  # the prefix of the chunks before, without a pass over this one
        cum = torch.cumsum(weighted, 0)
        at = torch.tensor([b - start - 1 for b in wanted], dtype=torch.int64, device=payload.device)
        for b, v in zip(wanted, cum[at].tolist()):
            prefix[b] = v
        carry = cum[-1]
    tails = [(i, b) for i, (o, n) in enumerate(spans) for b in range(o + n - n % 4, o + n)]
    tail_sums = [0] * len(spans)
    if tails:
        at = torch.tensor([b for _, b in tails], dtype=torch.int64, device=payload.device)
        terms = payload[at].to(torch.int64) * (((at + _TAIL) * 2 + 1) * _GOLDEN)
        for (i, _), v in zip(tails, terms.tolist()):
            tail_sums[i] += v
    mask = (1 << 64) - 1
    return [(prefix[(o + n) // 4] - prefix[o // 4] + t) & mask for (o, n), t in zip(spans, tail_sums)]
