"""Shared prompt prefixes in the simulator: block hashes, and the simulated engine's prefix cache.

This module owns two things (issue 12, DESIGN §4 invariant 8 seen from the engine's side):

* **Where a simulated request's prompt blocks come from.** A trace or a scenario says which
  prompts start alike; the engine and the ledger need chained hashes of the prompt's *full*
  blocks at the engine's block size (:attr:`kvbudget.RequestSpec.prefix_blocks`, the same
  shape :func:`kvbudget.block_hashes` gives from token ids). :func:`trace_prefix_blocks` expands
  Mooncake's ``hash_ids`` (one id per :data:`MOONCAKE_HASH_BLOCK_TOKENS` = 512 tokens) to
  blocks of ``B`` tokens: block ``k`` covers tokens ``[k*B, (k+1)*B)``, and its hash chains the
  hash of block ``k - 1`` with the ids of the 512-token blocks that range touches and ``k``, so
  two requests whose ``hash_ids`` agree up to the id covering block ``k``'s last token get equal
  hashes up to ``k``, and differ from the first id that differs. :func:`system_prompt_blocks`
  does the same for a scenario's shared system prompts (equal system prompt, equal blocks up to
  its last full block). As :func:`kvbudget.block_hashes` does, only the prompt's full blocks
  among its first ``prompt_tokens - 1`` tokens count (the engine always computes the last
  token); a block past what the trace's ids cover is the request's own.

* **The engine's prefix cache** (:class:`PrefixCache`), modelled on vLLM v1's
  ``KVCacheManager``: a block with a hash that live requests hold is stored once, with a
  reference count (``held``); a block is registered under its hash when it is *allocated*, so two
  twins admitted in the same step share (vLLM 0.32 measured here: ``num_cached_tokens`` 0, 640,
  640 for three twins of one step). When its last holder is freed a block stays cached but
  unreferenced (``cached``), and is evicted least-recently-used when the engine needs the space;
  a request frees its blocks tail first, as vLLM does, so a prompt's leading blocks outlive its
  tail. A newcomer's prefill skips the *leading* run of its blocks found held or cached (vLLM's
  ``find_longest_cache_hit``): that is its ``num_cached_tokens``.

A request's *own* full blocks (the unshared rest of its prompt, and its output) are cached too,
under hashes no other request has (the driver's ``_chain``): vLLM hashes every full block, so a
request preempted and admitted again finds its own blocks if they were not evicted meanwhile
(:meth:`PrefixCache.park` puts the blocks that filled up while it ran into the cache when it is
freed).

What is approximated: hashes are Python tuple hashes of integers (deterministic across runs,
collisions ignored); blocks are allocated all at admission, not chunk by chunk.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvbudget.validate import check_int

__all__ = [
    "MOONCAKE_HASH_BLOCK_TOKENS",
    "PrefixCache",
    "system_prompt_blocks",
    "trace_prefix_blocks",
]

MOONCAKE_HASH_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` entry of the Mooncake traces (FAST'25 release README)."""

# chain seeds (integers, so that hashes do not depend on PYTHONHASHSEED): trace ids and system
# prompts never name the same blocks
_TRACE_SEED = 0x6B76622D7472  # "kvb-tr"
_SYSTEM_SEED = 0x6B76622D7379  # "kvb-sy"


def _full_blocks(prompt_tokens: int, block_size: int) -> int:
    """Full blocks among the first ``prompt_tokens - 1`` tokens (the cacheable ones)."""
    return max(0, prompt_tokens - 1) // block_size


def trace_prefix_blocks(
    hash_ids: Sequence[int],
    prompt_tokens: int,
    block_size: int,
    *,
    hash_block_tokens: int = MOONCAKE_HASH_BLOCK_TOKENS,
) -> tuple[int, ...]:
    """Chained hashes of a trace request's full prompt blocks of ``block_size`` tokens, from its
    ``hash_ids`` of ``hash_block_tokens`` tokens each (module docstring)."""
    size = check_int("block_size", block_size, minimum=1)
    per_id = check_int("hash_block_tokens", hash_block_tokens, minimum=1)
    n = min(_full_blocks(prompt_tokens, size), len(hash_ids) * per_id // size)
    out: list[int] = []
    parent = _TRACE_SEED
    for k in range(n):
        first = k * size // per_id
        last = ((k + 1) * size - 1) // per_id
        # (the ids before ``first`` are in ``parent``; the range may touch more than one id)
        ids = hash_ids[first] if first == last else tuple(hash_ids[first : last + 1])
        parent = hash((parent, ids, k))
        out.append(parent)
    return tuple(out)


def system_prompt_blocks(
    system_prompt: int, system_prompt_tokens: int, prompt_tokens: int, block_size: int
) -> tuple[int, ...]:
    """Chained hashes of the full blocks a prompt shares with every prompt that starts with the
    same ``system_prompt`` (its first ``system_prompt_tokens`` tokens)."""
    size = check_int("block_size", block_size, minimum=1)
    shared = min(system_prompt_tokens, max(0, prompt_tokens - 1))
    parent = hash((_SYSTEM_SEED, system_prompt))
    out: list[int] = []
    for k in range(shared // size):
        parent = hash((parent, k))
        out.append(parent)
    return tuple(out)


class PrefixCache:
    """The simulated engine's prefix cache (module docstring): who holds which hashed block,
    and which unreferenced blocks are still cached, in LRU order.

    Costs: :meth:`allocate` and :meth:`free` are O(the request's prefix blocks);
    :meth:`trim` is O(blocks evicted). Nothing scans the cache.
    """

    __slots__ = ("cached", "evictions", "held")

    def __init__(self) -> None:
        #: hash -> how many engine-resident requests hold the block
        self.held: dict[int, int] = {}
        #: hashes of cached blocks no request holds, least recently used first
        self.cached: OrderedDict[int, None] = OrderedDict()
        self.evictions = 0

    def allocate(self, prefix: Sequence[int]) -> int:
        """A request is admitted with prompt blocks ``prefix``: hold each, registering the new
        ones under their hash at once. Returns how many leading blocks were found cached (held
        by another request or unreferenced): the blocks its prefill skips."""
        held = self.held
        cached = self.cached
        hits = 0
        leading = True
        for h in prefix:
            n = held.get(h)
            if n is not None:
                held[h] = n + 1
            else:
                if h in cached:
                    # a hit if it leads; past the first miss a fresh copy replaces the stale
                    # one, which comes to the same count of blocks
                    del cached[h]
                else:
                    leading = False
                held[h] = 1
            if leading:
                hits += 1
        return hits

    def free(self, prefix: Sequence[int]) -> None:
        """A request's blocks are freed: blocks no one else holds stay cached, tail first in
        the eviction order (as vLLM frees them), so the leading blocks are evicted last."""
        held = self.held
        cached = self.cached
        for h in reversed(prefix):
            n = held[h] - 1
            if n:
                held[h] = n
            else:
                del held[h]
                cached[h] = None

    def park(self, blocks: Sequence[int]) -> None:
        """Blocks no request holds any more enter the cache unreferenced, tail first (a freed
        request's blocks that were never registered: those that filled up while it ran)."""
        held = self.held
        cached = self.cached
        for h in reversed(blocks):
            if h not in held:
                cached[h] = None
                cached.move_to_end(h)

    def trim(self, free_blocks: int) -> int:
        """Evict least-recently-used unreferenced blocks until at most ``free_blocks`` are
        cached (the engine's blocks not held by any request). Returns how many were evicted."""
        cached = self.cached
        room = max(0, free_blocks)
        evicted = 0
        while len(cached) > room:
            cached.popitem(last=False)
            evicted += 1
        self.evictions += evicted
        return evicted
