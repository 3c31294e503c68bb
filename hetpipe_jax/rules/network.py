"""The network rule: every node has one network interface (NIC) that all its inter-node traffic shares.

Pure (standard library only). HetPipe §8.1's cluster is four nodes of four GPUs "connected via Infiniband
(56 Gbps)": each node has one host channel adapter, and the GPUs of a node talk to each other over PCIe, not over it.
So the virtual workers (VWs) placed on one node share that node's NIC for whatever leaves or enters the node:
activations and gradients across an inter-node cut of a pipeline, wave pushes to and pull replies from parameter
server (PS) shards on other nodes, and the rings of an all-reduce that span nodes. Traffic between GPUs of one node
(PCIe / NVLink) does not touch the NIC.

Model (:class:`NicState`): a NIC is full duplex (InfiniBand is), so it is two resources, its send side and its
receive side. A transfer from node A to node B is a *leg* ``(A, B, seconds)`` whose ``seconds`` is the link's
``LinkSpec.transfer_time_s`` of its bytes (latency + bytes / achieved bandwidth, :mod:`hetpipe_jax.costs.cluster`);
it holds A's send side and B's receive side for those seconds, and starts when both are free and its data is ready.
Legs are served one at a time per side, first come first served in the order they are requested (the order of
events in virtual time; ties in creation order), without back-filling an earlier gap. A leg inside one node
(``src == dst``, or an unknown node) takes its seconds without touching a NIC. A transfer made of several legs (a PS
push of a VW whose stages sit on several nodes, to shards on several nodes) sends them one after another, as one
sender process does; the engine requests each leg when the previous one has arrived (its data is there), so a leg
never books a NIC ahead of time and holds back a transfer that could run now (booking all legs at the push measured
a 39% loss on ResNet-152 ED at 25% NIC load, an artefact).

Why FIFO serialisation and not processor sharing: with k equal transfers requested together, both give the last
one the same finish time k x d and both keep the NIC busy for exactly the bytes it carried / its bandwidth, which is
the bound a real NIC cannot beat; FIFO needs no re-scheduling of transfers already started (each leg's end is known
when it starts), so the event engine stays one event per transfer and deterministic. It is pessimistic for a small
message queued behind a large one (processor sharing would let it through sooner).

The all-reduce of the all-reduce methods applies the same rule in closed form
(:func:`hetpipe_jax.costs.allreduce_cost.allreduce_time_s`): the rings that cross a node's NIC are served one
after another, like the segments one GPU holds.

Used by the event engine (:mod:`hetpipe_jax.sim.engine`, ``EngineConfig.shared_nic``, on by default for every
method) and so by virtual time, ``simulate`` and ``compare``; ``EngineConfig(shared_nic=False)`` is the old per-link
model (every transfer at full link speed however many share the node).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence


class Leg(NamedTuple):
  """One transfer between two nodes: ``src`` and ``dst`` node names (``None``: unknown, treated as intra-node) and
  ``seconds`` of it on an idle link (``LinkSpec.transfer_time_s``)."""

  src: str | None
  dst: str | None
  seconds: float

  @property
  def inter_node(self) -> bool:
    return self.src is not None and self.dst is not None and self.src != self.dst


class NicState:
  """The NICs of a cluster in virtual time: per node, when its send and its receive side are next free.

  Nodes are created on first use. ``busy_s[node] = [send seconds, receive seconds]`` is the time each side spent
  carrying legs (the lower-bound check: a NIC that carried ``b`` bytes at bandwidth ``B`` was busy at least
  ``b / B``).
  """

  __slots__ = ("send_free", "recv_free", "busy_s")

  def __init__(self):
    self.send_free: dict[str, float] = {}
    self.recv_free: dict[str, float] = {}
    self.busy_s: dict[str, list[float]] = {}

  def leg_end(self, t: float, leg: Leg) -> float:
    """Serves one leg whose data is ready at ``t`` (seconds); returns when it has arrived.

    An intra-node leg ends at ``t + leg.seconds``; an inter-node leg starts at
    ``max(t, send side of src free, receive side of dst free)`` and holds both sides until it ends.
    """
    if not leg.inter_node:
      return t + leg.seconds
    src, dst, d = leg
    start = max(t, self.send_free.get(src, 0.0), self.recv_free.get(dst, 0.0))
    end = start + d
    self.send_free[src] = end
    self.recv_free[dst] = end
    self.busy_s.setdefault(src, [0.0, 0.0])[0] += d
    self.busy_s.setdefault(dst, [0.0, 0.0])[1] += d
    return end

  def transfer_end(self, t: float, legs: Sequence[Leg]) -> float:
    """Serves ``legs`` one after another from ``t``; returns when the last has arrived (``t`` for none)."""
    for leg in legs:
      t = self.leg_end(t, leg)
    return t

