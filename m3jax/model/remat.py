"""What a rematerialised layer keeps from its forward for its backward: `model.remat_policy`'s names and their
`jax.checkpoint` policies."""

from __future__ import annotations

import jax

from m3jax.model.sparse import INDEX_BLOCK_IDS
from sharding.expert import MOE_EXPERT_OUT, MOE_ROUTING

# model.remat_policy: what a rematerialised layer keeps from its forward for the backward. "full" keeps
# only the layer's input (the whole forward runs again in the backward); "save_dots" also keeps the
# outputs of the matmuls without batch dimensions (the q/k/v/o, indexer, router, shared-expert and dense-MLP
# projections: token-sized), so the backward recomputes norms, RoPE, the attention core, the indexer scores
# and the expert dispatch but not those projections. The attention core's and the routed experts'
# batched / looped matmuls are not kept (their outputs are [S, S]- or receive-pool-sized). "save_dots_experts"
# keeps those and the routed experts' output rows too (`sharding.expert.MOE_EXPERT_OUT`, T * k rows of d per MoE
# layer), which the router weights' gradient reads: the backward then does not re-run the experts' forward to
# get them (the tiled kernel's backward recomputes its gate/up itself; under ragged_dot the gate/up run again).
# Every policy also keeps the integer decisions, which have no gradient and cost a few bytes per token: the
# gather path's block ids (`m3jax.model.sparse.INDEX_BLOCK_IDS`, [B, S, Hi, K] int32 per sparse layer), so the
# indexer's scores and top-k run once per step, not again in the backward, and the MoE routing's expert ids
# and row order (`sharding.expert.MOE_ROUTING`, 2 x T k int32 per MoE layer), so its top-k and sort do not either.
REMAT_POLICIES = ("full", "save_dots", "save_dots_experts")


def remat_policy_fn(name: str):
    """The `jax.checkpoint` policy of a `REMAT_POLICIES` name."""
    if name not in REMAT_POLICIES:
        raise ValueError(f"remat_policy={name!r}: expected one of {REMAT_POLICIES}")
    cp = jax.checkpoint_policies
    ids = cp.save_only_these_names(INDEX_BLOCK_IDS, MOE_ROUTING)
    if name == "full":
        return ids
    if name == "save_dots":
        return cp.save_from_both_policies(cp.dots_with_no_batch_dims_saveable, ids)
    return cp.save_from_both_policies(cp.dots_with_no_batch_dims_saveable,
                                      cp.save_only_these_names(MOE_EXPERT_OUT, INDEX_BLOCK_IDS, MOE_ROUTING))
