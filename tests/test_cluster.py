"""Cluster specs: the shipped clusters load, and bad specs fail with a message naming the problem (§8.1)."""

import copy
import json

import pytest

from hetpipe_jax.costs import cluster as cluster_lib


def paper_dict():
  with open(cluster_lib.load_cluster.__globals__["CLUSTER_DIR"] + "/hetpipe_paper.json") as f:
    return json.load(f)


def test_hetpipe_paper_matches_table_1_and_section_8_1():
  c = cluster_lib.load_cluster("hetpipe_paper")
  assert [n.name for n in c.nodes] == ["V", "R", "G", "Q"]
  assert len(c.gpus()) == 16
  assert all(len(set(n.gpu_types)) == 1 and len(n.gpu_types) == 4 for n in c.nodes)
  gib = 2**30
  assert {t.name: t.memory_bytes // gib for t in c.gpu_types.values()} == {
      "TITAN V": 12, "TITAN RTX": 24, "GeForce RTX 2060": 6, "Quadro P4000": 8}
  assert c.gpu_types["TITAN V"].memory_bandwidth_bytes_per_s == 653e9
  assert c.gpu_types["TITAN V"].peak_fp32_flops_per_s == pytest.approx(5120 * 1455e6 * 2)
  assert c.intra_node_link.bandwidth_bytes_per_s == 15.75e9
  assert c.inter_node_link.bandwidth_bytes_per_s == 56e9 / 8
  assert c.link("V", "V") is c.intra_node_link and c.link("V", "R") is c.inter_node_link


def test_local_cpu_maps_gpus_to_jax_devices():
  c = cluster_lib.load_cluster("local_cpu")
  assert [c.local_devices[g.gpu_id] for g in c.gpus()] == [0, 1, 2, 3]
  assert all(t.measured_device_kind == "cpu" for t in c.gpu_types.values())


def test_load_by_path(tmp_path):
  p = tmp_path / "mine.json"
  d = paper_dict()
  d["name"] = "mine"
  p.write_text(json.dumps(d))
  assert cluster_lib.load_cluster(str(p)).name == "mine"


def test_unknown_cluster_lists_known_names():
  with pytest.raises(ValueError, match=r"unknown cluster 'nope'.*hetpipe_paper"):
    cluster_lib.load_cluster("nope")


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["nodes"][0]["gpus"].__setitem__(0, "TITAN Z"), r"unknown GPU type 'TITAN Z'"),
    (lambda d: d["gpu_types"][0].__setitem__("memory_bytes", 0), r"'TITAN V': memory_bytes must be positive"),
    (lambda d: d["gpu_types"][1].__setitem__("peak_fp32_flops_per_s", -1.0),
     r"'TITAN RTX': peak_fp32_flops_per_s must be positive"),
    (lambda d: d["inter_node_link"].__setitem__("bandwidth_bytes_per_s", 0),
     r"link 'InfiniBand.*bandwidth_bytes_per_s must be positive"),
    (lambda d: d["intra_node_link"].__setitem__("efficiency", 1.5), r"efficiency must be in \(0, 1\]"),
    (lambda d: d["local_devices"].__setitem__("X/9", 0), r"local_devices: unknown GPU id 'X/9'"),
    (lambda d: d.pop("inter_node_link"), r"missing field 'inter_node_link'"),
    (lambda d: d["nodes"].append(copy.deepcopy(d["nodes"][0])), r"duplicate node names"),
])
def test_bad_specs_are_named(mutate, message):
  d = paper_dict()
  mutate(d)
  with pytest.raises(ValueError, match=message):
    cluster_lib.cluster_from_dict(d)


def test_transfer_time_uses_efficiency_and_latency():
  link = cluster_lib.LinkSpec("l", bandwidth_bytes_per_s=1e9, efficiency=0.5, latency_s=1e-3)
  assert link.transfer_time_s(0) == 0.0
  assert link.transfer_time_s(1e9) == pytest.approx(2.001)
