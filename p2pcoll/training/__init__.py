"""Synchronous data-parallel training rounds, with no parameter server.

Every worker holds a replica of the model. Each round it computes gradients on its own part
of the data, the group reduces them (an allreduce: every worker gets the result), and every
worker applies the same update to the same weights, so the replicas stay bit-for-bit equal::

    async with p2pcoll.join() as g:
        params = await training.broadcast_parameters(g, params, root=0)   # identical start
        for step in range(steps):
            grads = compute_gradients(params, my_shard)                    # name -> ndarray
            grads = await training.allreduce_gradients(g, grads, op="avg")
            for name, grad in grads.items():
                params[name] -= lr * grad                                  # same bits everywhere
            if step % 100 == 0:
                await training.check_replicas(g, params)                   # ReplicaDivergence?

Names. Parameters and gradients are pytrees of arrays: nested dicts (and lists or tuples)
whose leaves are numpy arrays or CPU torch tensors. A leaf is named by its path,
``"layer1.weight"`` or ``"blocks.0.bias"``, and the leaves are taken in the one leaf order
of :mod:`p2pcoll.pytree` (dict keys sorted at each level), the order the group's collectives
use too. Torch tensors are used through ``tensor.detach().numpy()``, which shares their
memory: nothing is copied on the way in, and :func:`broadcast_parameters` writes into the
tensors themselves.

Buckets (tensor fusion, :mod:`.buckets`). The gradients are packed into a few flat buffers,
one dtype per buffer, of about ``bucket_bytes`` each (:class:`BucketPlan`); each buffer is
one allreduce, and the results are cut back into tensors as views, without copying. The
packed buffers are kept for the next round (per group, or per :class:`GradientReducer`): as
much memory as the gradients, in exchange for not faulting in fresh pages every round.

Checks (:mod:`.agreement`). Before a round moves any gradient, the ranks compare a 48-byte
header (one small allgather): which function they are in, the round number, and a digest of
the gradients' names, shapes and dtypes and of the settings that shape the buckets. Buckets
filled from different tensors would otherwise be reduced into silent garbage; instead every
rank raises the same :class:`~p2pcoll.CollectiveMismatch`, naming the round or the first
tensor that differs, and the group stays usable. Round numbers are counted per group
(:mod:`.state`; every call of :func:`allreduce_gradients` or
:meth:`GradientReducer.start_round` is a round, an empty one included), so a rank that
skipped or repeated a round is caught at its next one. :func:`check_replicas` compares
digests of the parameters themselves; a :class:`GradientReducer` can do it every K rounds
inside that same header, at no extra cost in messages. A NaN or Inf in the reduced gradients
is reported by name (:class:`NonFiniteGradients`, a warning or nothing, see ``nonfinite``);
the reduced values are equal on every rank, so every rank reports the same thing.

Overlap (:mod:`.reducer`). :func:`allreduce_gradients` takes gradients that are all ready. A
:class:`GradientReducer` takes them one at a time as the backward pass produces them
(:meth:`Round.add`) and starts each bucket's allreduce as soon as the bucket is full.

Elastic rounds (:mod:`.elastic`). :func:`train_elastic` runs the rounds itself, in groups
that change: ``step(group, round, state)`` gives this rank's gradients, the loop reduces
them and ``apply(state, grads, round)`` updates the state. When a peer dies the survivors
form a new group at once (ranks in their old order); peers that arrive are let in at the
next round boundary; every new group starts from the state of its most advanced member,
so no round is applied twice or skipped. Fewer peers than ``min_world_size`` stop the job
with :class:`WorldTooSmall`. The module docstring gives the argument for exactly-once.

Slow links (:mod:`.powersgd`, :mod:`.topk`, :mod:`.local_sgd`). Modes that move less than
an allreduce of every gradient, each keeping the replicas bit-identical:
:class:`PowerSGD` (rank-r factors with error feedback and warm start: ``r (n + m)`` instead
of ``n m`` per matrix), :class:`TopK` (each rank's largest entries, with error feedback,
over one allgather, summed in rank order), :class:`LocalSGD` (average the parameters every
H steps) and :class:`DiLoCo` (an outer step with Nesterov momentum on the averaged
parameter change every H steps, the change optionally sent through a codec or as sparse
2-bit codes, ``compressor="topk2bit"``; with
``fragments=F`` the streaming variant, fragments synced at staggered steps, optionally
overlapped with the inner steps); :class:`DiLoCoRounds` runs DiLoCo under
:func:`train_elastic`. Their settings (rank r, fraction, H, F, codec ...) go into the
agreement header, so ranks that differ get a CollectiveMismatch naming the setting; each
counts its bytes against a plain allreduce (``.traffic``).

Every coroutine here is a sequence of the group's collectives and raises what they raise
(:class:`~p2pcoll.CollectiveTimeout`, :class:`~p2pcoll.PeerLost`,
:class:`~p2pcoll.GroupBroken`, ...), besides the errors of :mod:`.errors`. Cancellation in the
middle of one breaks the group, as for any collective. Issue other collectives on the same
group between rounds, not during one.

Modules: ``buckets`` (TensorSpec, Bucket, BucketPlan), ``agreement`` (the header and the
first-difference report), ``replicas`` (check_replicas), ``gradients``
(allreduce_gradients), ``parameters`` (broadcast_parameters), ``reducer`` (GradientReducer,
Round), ``nonfinite`` (NaN/Inf reports), ``state`` (round numbers per group), ``elastic``
(train_elastic, ElasticResult, Formation), ``powersgd`` (PowerSGD), ``topk`` (TopK),
``heal`` (heal, HealProgress, HealReport, HealFailed: a joiner's state striped over every
survivor), ``local_sgd`` (LocalSGD, DiLoCo, DiLoCoRounds), ``outer`` (OuterSGD), ``fragments``
(streaming DiLoCo's fragments), ``compressors`` (DiLoCo's ``compressor=``: TopK2Bit),
``sparse_codes`` (its levels and wire packing), ``modes`` (what those share), ``errors``.
"""

from __future__ import annotations

from ..pytree import named_leaves, replace_leaves
from .buckets import DEFAULT_BUCKET_BYTES, Bucket, BucketPlan, TensorSpec
from .elastic import ElasticResult, Formation, train_elastic
from .errors import NonFiniteGradients, RoundError, WorldTooSmall
from .gradients import allreduce_gradients
from .diloco_rounds import DiLoCoRounds
from .heal import HealFailed, HealProgress, HealReport, heal
from .local_sgd import DiLoCo, LocalSGD, OuterSGD
from .nonfinite import Nonfinite
from .parameters import broadcast_parameters
from .powersgd import PowerSGD
from .reducer import GradientReducer, Round
from .replicas import check_replicas
from .topk import TopK

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "Bucket",
    "BucketPlan",
    "DiLoCo",
    "DiLoCoRounds",
    "ElasticResult",
    "Formation",
    "GradientReducer",
    "HealFailed",
    "HealProgress",
    "HealReport",
    "LocalSGD",
    "NonFiniteGradients",
    "Nonfinite",
    "OuterSGD",
    "PowerSGD",
    "Round",
    "RoundError",
    "TensorSpec",
    "TopK",
    "WorldTooSmall",
    "allreduce_gradients",
    "broadcast_parameters",
    "check_replicas",
    "heal",
    "named_leaves",
    "replace_leaves",
    "train_elastic",
]
