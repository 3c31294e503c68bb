"""Mutation check: small semantic bugs, applied one at a time to a copy of the repository, must each fail a test.

Every mutation names the file, the exact text it replaces (which must occur exactly once, so a refactor that moves the
code makes the mutation fail loudly instead of silently testing nothing), its replacement, and the tests that should
catch it. Each runs in its own temporary copy of the repository (the package, tests, configs; the venv is shared),
with ``pytest -x`` on the named tests. A mutation is *caught* when a test fails; *survived* when all pass; *error*
when the mutation no longer applies or pytest could not run (exit codes 2-5); *timeout* counts as caught (a hang is
noticed) but is reported. Prints one JSON document; exits 1 unless every mutation is caught.

  .venv/bin/python scripts/mutation_check.py [--only=name,name] [--jobs=2] [--list] [--test_timeout_s=240]
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # pylint: disable=wrong-import-position

from hetpipe_jax.paths import REPO_ROOT  # pylint: disable=wrong-import-position

_ONLY = flags.DEFINE_list("only", [], "Run only these mutations (default: all).")
_JOBS = flags.DEFINE_integer("jobs", 2, "Mutations run in parallel.")
_LIST = flags.DEFINE_bool("list", False, "Print the mutations (and whether each still applies) and exit.")
_TIMEOUT_S = flags.DEFINE_integer("test_timeout_s", 240, "Wall-clock limit of one mutation's test run.")
_BASELINE = flags.DEFINE_bool("baseline", True, "First run every named test on an unmutated copy: a test that fails "
                              "without a mutation would make every mutation look caught (CI skips it: the suite itself "
                              "is the baseline there).")

COPIED = ("hetpipe_jax", "tests", "experiments", "scripts", "pytest.ini", "README.md")


@dataclasses.dataclass(frozen=True)
class Mutation:
  """One small semantic bug.

  Attributes:
    name: short id.
    path: file relative to the repository root.
    old: text replaced (must occur exactly once).
    new: replacement.
    tests: pytest node ids or files that must catch it.
    what: the bug in words.
  """

  name: str
  path: str
  old: str
  new: str
  tests: tuple[str, ...]
  what: str


# runtime_hands_off_after_updates moves the hand-off of ready tasks (the scheduler thread's step 3) after the
# completed minibatches' updates (its step 4): vw_driver.run's text of both.
_HANDOFF = (
    "        if taken:\n"
    "          with lock:\n"
    "            submit_ready()\n")
_UPDATES = (
    "        # 4. Completed minibatches: every stage's update (a new weight version), wave ends and their pulls.\n"
    "        if finished:\n"
    "          t = time.perf_counter()\n"
    "          for c in finished:\n"
    "            p = c.task.minibatch_id\n"
    "            with lock:\n"
    "              mb = inflight.pop(p)\n"
    "            vw.complete_minibatch(mb, c.end_s)\n"
    "            num_finished += 1\n"
    "            wave, pull = vw.sync.on_minibatch_complete(p)\n"
    "            if wave is not None:\n"
    "              t_wave = time.perf_counter()\n"
    "              if vw.end_wave(wave):\n"
    "                vw.sync.on_reduced(wave)  # the all-reduce is a blocking collective: the update is applied\n"
    "              stats.push_s += time.perf_counter() - t_wave\n"
    "            if pull is not None:\n"
    "              ps.request_pull(pull)\n"
    "          stats.update_s += time.perf_counter() - t\n")


MUTATIONS = (
    # ---- the six bugs of the test audit
    Mutation("wsp_caps_D_at_1", "hetpipe_jax/rules/wsp.py",
             "def required_global_clock(local_clock: int, staleness_bound: int) -> int:\n"
             "  \"\"\"The smallest global clock the VW's weights must include: ``max(0, c - D)`` (HetPipe §5).\"\"\"\n"
             "  return max(0, local_clock - staleness_bound)",
             "def required_global_clock(local_clock: int, staleness_bound: int) -> int:\n"
             "  \"\"\"The smallest global clock the VW's weights must include: ``max(0, c - D)`` (HetPipe §5).\"\"\"\n"
             "  return max(0, local_clock - min(staleness_bound, 1))",
             ("tests/test_virtual_time.py::test_virtual_time_reaches_staleness_bound_two_without_wave_end_pulls",),
             "the VW never runs more than 1 wave ahead whatever D is"),
    Mutation("loss_halved", "hetpipe_jax/runtime/objectives.py",
             "optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()",
             "optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean() * 0.5",
             ("tests/test_references.py",), "the training loss is half the cross-entropy"),
    Mutation("loss_sum_not_mean", "hetpipe_jax/runtime/objectives.py",
             "optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()",
             "optax.softmax_cross_entropy_with_integer_labels(logits, labels).sum()",
             ("tests/test_references.py",), "the minibatch loss is summed, not averaged, over examples"),
    Mutation("install_pull_forgets_own_waves", "hetpipe_jax/runtime/update_rules.py",
             "    keep = wsp.own_waves_after_pull(self.own_waves, vector_clock[self.vw.vw_id])\n",
             "    keep = []\n",
             ("tests/test_pipeline.py::test_pull_while_own_waves_are_unapplied_keeps_them",),
             "pulled weights lose the VW's own pushed but unapplied waves"),
    Mutation("partitioner_no_second_pass", "hetpipe_jax/planning/partitioner.py",
             "  if np.isfinite(total):\n    cand = _to_partition(problem, classes, by_class, order2, cuts2)",
             "  if False:\n    cand = _to_partition(problem, classes, by_class, order2, cuts2)",
             ("tests/test_partitioner.py",), "min-max optima are not tie-broken by least total time"),
    Mutation("auto_packing_demands_one_more_vw", "hetpipe_jax/planning/auto_allocation.py",
             "    if not self.beats(slowest) or not self.packable(have, k):",
             "    if not self.beats(slowest) or not self.packable(have, min(k + 1, self.num_vws)):",
             ("tests/test_allocator.py::test_auto_matches_exhaustive_search_over_every_allocation",),
             "auto's packing relaxation prunes too much (asks room for one VW more than remain)"),
    Mutation("relaxed_bound_too_low", "hetpipe_jax/planning/inflight.py",
             "  bound = MS_PER_S / best_ms if np.isfinite(best_ms) else 0.0",
             "  bound = 0.98 * MS_PER_S / best_ms if np.isfinite(best_ms) else 0.0",
             ("tests/test_allocator.py::test_throughput_bounds_are_upper_bounds_of_every_small_virtual_worker",),
             "the relaxed-partition throughput bound is 2 % below its proof"),
    Mutation("round_trip_bound_one_cut_too_many", "hetpipe_jax/planning/inflight.py",
             "  return float(compute + 2 * cuts[:len(gpu_types) - 1].sum())",
             "  return float(compute + 2 * cuts[:len(gpu_types)].sum())",
             ("tests/test_allocator.py::test_throughput_bounds_are_upper_bounds_of_every_small_virtual_worker",),
             "the round-trip lower bound counts one cut more than a partition crosses (Little's-law bound too low)"),
    Mutation("little_bound_at_one_nm_less", "hetpipe_jax/planning/inflight.py",
             "  return max_num_inflight * MS_PER_S / trip * (1 + 1e-9) if trip > 0 else np.inf",
             "  return (max_num_inflight - 0.5) * MS_PER_S / trip * (1 + 1e-9) if trip > 0 else np.inf",
             ("tests/test_allocator.py::test_throughput_bounds_are_upper_bounds_of_every_small_virtual_worker",),
             "the Little's-law bound uses half an Nm less than the range's top"),
    Mutation("auto_levels_skip_nm_1", "hetpipe_jax/planning/auto_allocation.py",
             "[(m, m) for m in range(1, self.tail_nm)] + [(self.tail_nm, None)]",
             "[(m, m) for m in range(2, self.tail_nm)] + [(self.tail_nm, None)]",
             ("tests/test_allocator.py::test_auto_matches_exhaustive_search_over_every_allocation",),
             "auto's Nm levels miss system Nm = 1 (splits whose best Nm is 1 are never searched there)"),
    Mutation("engine_no_ps_link_contention", "hetpipe_jax/sim/engine.py",
             "    if contention:\n      self._ps_link_free = end",
             "    if False:\n      self._ps_link_free = end",
             ("tests/test_engine.py",), "ps_link_contention=True is ignored"),
    # ---- network rule (shared NICs)
    Mutation("nic_no_queue", "hetpipe_jax/rules/network.py",
             "    start = max(t, self.send_free.get(src, 0.0), self.recv_free.get(dst, 0.0))",
             "    start = t",
             ("tests/test_network.py",), "a NIC carries any number of transfers at once (no sharing)"),
    Mutation("nic_half_duplex", "hetpipe_jax/rules/network.py",
             "    self.send_free[src] = end\n    self.recv_free[dst] = end",
             "    self.send_free[src] = self.recv_free[src] = end\n    self.recv_free[dst] = self.send_free[dst] = end",
             ("tests/test_network.py",), "a NIC's send and receive sides block each other"),
    Mutation("nic_intra_node_uses_the_nic", "hetpipe_jax/rules/network.py",
             "return self.src is not None and self.dst is not None and self.src != self.dst",
             "return self.src is not None and self.dst is not None",
             ("tests/test_network.py",), "traffic between GPUs of one node queues at the node's NIC"),
    Mutation("engine_sends_ignore_the_nic", "hetpipe_jax/sim/engine.py",
             "    if config.shared_nic:\n      for s in range(s_count):",
             "    if False:\n      for s in range(s_count):",
             ("tests/test_network.py",), "pipeline activations and gradients never wait for a shared NIC"),
    Mutation("engine_ps_ignores_the_nic", "hetpipe_jax/sim/engine.py",
             "        end = self.nic.leg_end(t, legs[i])",
             "        end = t + legs[i].seconds",
             ("tests/test_network.py",), "PS pushes and pull replies never wait for a shared NIC"),
    Mutation("compare_ignores_shared_nic", "hetpipe_jax/sim/compare.py",
             "records=False, method=plan.method, shared_nic=config.shared_nic,\n",
             "records=False, method=plan.method,\n",
             ("tests/test_network.py",), "compare --noshared_nic still runs the shared-NIC rule"),
    Mutation("simulate_ignores_shared_nic", "hetpipe_jax/simulate.py",
             "                               shared_nic=_SHARED_NIC.value,\n",
             "",
             ("tests/test_network.py",), "simulate --noshared_nic still runs the shared-NIC rule (and records it)"),
    Mutation("engine_ps_legs_booked_ahead", "hetpipe_jax/sim/engine.py",
             "    if self.config.shared_nic and legs and not self.config.ps_link_contention:",
             "    if False:",
             ("tests/test_network.py",), "a push books every leg's NIC time when sent, holding back transfers "
             "that could run before its later legs are ready"),
    Mutation("engine_pull_overtakes_a_push_on_the_nics", "hetpipe_jax/sim/engine.py",
             "    if vw.leg_pushes_arrived < vw.leg_pushes_sent:  # behind a push",
             "    if False:  # behind a push",
             ("tests/test_network.py",), "a pull request overtakes the VW's push still crossing the NICs"),
    Mutation("allreduce_ignores_the_nic", "hetpipe_jax/planning/allreduce_cost.py",
             "  if not shared_nic:\n    per_nic = {}",
             "  per_nic = {}",
             ("tests/test_network.py",), "rings crossing one NIC run at full speed together"),
    # ---- pipeline schedule
    Mutation("schedule_nm_plus_one_in_flight", "hetpipe_jax/rules/schedule.py",
             "    return self.num_in_flight < self.num_inflight",
             "    return self.num_in_flight <= self.num_inflight",
             ("tests/test_schedule.py", "tests/test_engine.py"), "Nm + 1 minibatches may be in flight"),
    Mutation("schedule_wave_end_off_by_one", "hetpipe_jax/rules/wsp.py",
             "  return (minibatch_id + 1) % num_inflight == 0",
             "  return minibatch_id % num_inflight == 0",
             ("tests/test_wsp.py",), "a wave ends at its first minibatch, not its last"),
    # ---- WSP
    Mutation("wsp_required_clock_off_by_one", "hetpipe_jax/rules/wsp.py",
             "  return max(0, local_clock - staleness_bound)",
             "  return max(0, local_clock - staleness_bound - 1)",
             ("tests/test_wsp.py",), "the staleness bound allows D + 1"),
    Mutation("wsp_pulls_served_before_clock", "hetpipe_jax/rules/wsp.py",
             "    ready = [v for v, required in pending.items() if required <= clock]",
             "    ready = [v for v, required in pending.items() if required <= clock + 1]",
             ("tests/test_wsp.py",), "a pending pull is answered one clock too early"),
    # ---- parameter server
    Mutation("ps_applies_update_negated", "hetpipe_jax/ps/param_server.py",
             "      self.weights += self._pending.pop(key)",
             "      self.weights -= self._pending.pop(key)",
             ("tests/test_virtual_time.py",), "the PS subtracts wave updates instead of adding them"),
    Mutation("ps_on_receipt_update_negated", "hetpipe_jax/ps/param_server.py",
             "      self.weights += np.asarray(delta, np.float32)",
             "      self.weights -= np.asarray(delta, np.float32)",
             ("tests/test_virtual_time.py",), "the on-receipt PS subtracts wave updates instead of adding them"),
    # ---- WSP as the paper defines it: updates applied on receipt, vector clocks (issue 14)
    Mutation("ps_on_receipt_waits_for_the_clock", "hetpipe_jax/rules/wsp.py",
             "    if self.ps_apply == \"on_receipt\":",
             "    if False:",
             ("tests/test_wsp.py",), "ps_apply='on_receipt' defers each wave until every VW pushed it"),
    Mutation("install_pull_readds_waves_the_ps_holds", "hetpipe_jax/runtime/update_rules.py",
             "    keep = wsp.own_waves_after_pull(self.own_waves, vector_clock[self.vw.vw_id])\n",
             "    keep = wsp.own_waves_after_pull(self.own_waves, min(vector_clock))\n",
             ("tests/test_pipeline.py::test_pull_while_own_waves_are_unapplied_keeps_them",),
             "a pull re-adds own waves beyond the global clock that the on-receipt PS already applied"),
    Mutation("records_claim_the_global_clock_only", "hetpipe_jax/runtime/virtual_worker.py",
             "              v.local_updates, v.global_clock, v.vector_clock, now)",
             "              v.local_updates, v.global_clock, (v.global_clock,) * self.num_virtual_workers, now)",
             ("tests/test_virtual_time.py::test_virtual_time_run_equals_replay_of_its_versions",),
             "minibatch records hide the extra updates their weights hold"),
    Mutation("engine_forgets_the_pulled_vector_clock", "hetpipe_jax/sim/engine.py",
             "        vw.vector_clock = arg\n",
             "",
             ("tests/test_engine.py",), "engine records keep the initial vector clock after pulls"),
    # ---- checkpoints and resume (issue 9)
    Mutation("resume_skips_optimizer_state", "hetpipe_jax/jobs/virtual_job.py",
             "      vw.load_opt_state(*point.opt_states[v])\n",
             "",
             ("tests/test_resume.py::test_virtual_run_interrupted_and_resumed_is_bit_identical_to_the_uninterrupted_run",),
             "a resumed VW starts with a fresh optimizer state"),
    Mutation("resume_restarts_the_data", "hetpipe_jax/jobs/virtual_job.py",
             "      off.clock, off.minibatch = first, start_mb + (first - clock0) * nm\n      server.wave_offset",
             "      off.clock, off.minibatch = first, (first - clock0) * nm\n      server.wave_offset",
             ("tests/test_resume.py::test_virtual_run_interrupted_and_resumed_is_bit_identical_to_the_uninterrupted_run",),
             "a resumed VW reads its data from the start again"),
    Mutation("ps_accepts_nan_updates", "hetpipe_jax/ps/param_server.py",
             "    if not np.isfinite(delta).all():",
             "    if False:",
             ("tests/test_resume.py::test_parameter_server_refuses_nan_and_wrong_size_before_touching_the_weights",),
             "the PS adds NaN/Inf updates to the global weights"),
    Mutation("opt_state_layers_misaligned", "hetpipe_jax/runtime/opt_state.py",
             "      parts = [layer[k] for layer in per_layer]",
             "      parts = [layer[k] for layer in per_layer[::-1]]",
             ("tests/test_resume.py",), "optimizer states land on the wrong layers after a resume"),
    # ---- runtime
    Mutation("dispatch_uses_current_version", "hetpipe_jax/runtime/update_rules.py",
             "    return mb.version.params[stage_id]\n",
             "    return self.vw.version.params[stage_id]\n",
             ("tests/test_pipeline.py",), "a stage uses the VW's latest weights, not the minibatch's version"),
    # ---- partitioner and cost model
    Mutation("cost_model_no_optimizer_state", "hetpipe_jax/planning/cost_model.py",
             "    return params * copies + opt + kept",
             "    return params * copies + kept",
             ("tests/test_cost_model.py",), "stage memory leaves out the optimizer state"),
    Mutation("schedule_memory_accepts_unchecked", "hetpipe_jax/planning/inflight_memory.py",
             "    if np.all(peaks <= h):",
             "    if True:",
             ("tests/test_inflight_memory.py",),
             "the schedule mode accepts a partition without checking it fits at its own schedule peaks"),
    Mutation("dp_held_of_stage_zero_everywhere", "hetpipe_jax/planning/partitioner.py",
             "mid[k - 1][c][None]",
             "mid[0][c][None]",
             ("tests/test_inflight_memory.py",), "the DP counts every stage position with stage 0's held count"),
    Mutation("schedule_bound_run_too_short", "hetpipe_jax/planning/inflight_memory.py",
             "  return 4 * num_stages * num_inflight + 4 * num_inflight",
             "  return num_inflight",
             ("tests/test_inflight_memory.py",), "the schedule bound is taken from the start-up burst alone"),
    Mutation("one_f_one_b_extra_warmup", "hetpipe_jax/rules/methods.py",
             "    k = num_stages - stage_id\n",
             "    k = num_stages - stage_id + 1\n",
             ("tests/test_methods.py",), "1F1B-flush runs one warm-up forward too many"),
    Mutation("allreduce_no_flush", "hetpipe_jax/rules/wsp.py",
             "  if cap is not None and cap - first < room:",
             "  if False:",
             ("tests/test_methods.py",), "the next step's micro-batches start before the all-reduced update"),
    Mutation("engine_allreduce_free", "hetpipe_jax/sim/engine.py",
             "    done = t + self.allreduce_s",
             "    done = t",
             ("tests/test_methods.py",), "the engine's all-reduce takes no time"),
    Mutation("gpipe_memory_holds_one", "hetpipe_jax/rules/methods.py",
             '  if method.order == "gpipe":\n    k = window',
             '  if method.order == "gpipe":\n    k = 1',
             ("tests/test_methods.py",), "GPipe's order and memory hold one micro-batch"),
    Mutation("pipedream_stage_update_skipped", "hetpipe_jax/runtime/pipedream_updates.py",
             "      self.stage_update(stage_id, mb, grads)\n",
             "      pass\n",
             ("tests/test_methods_runtime.py::test_pipedream_weight_stashing_equals_sequential_replay",),
             "PipeDream's stages never apply their own updates (weights stay at the pulled ones)"),
    Mutation("allreduce_mean_over_one_vw", "hetpipe_jax/runtime/flush_step.py",
             "[np.float32(vw.num_virtual_workers * vw.num_inflight)]",
             "[np.float32(vw.num_inflight)]",
             ("tests/test_methods_runtime.py::test_virtual_time_allreduce_methods_equal_union_training",),
             "the all-reduced gradient is summed over the VWs, not averaged"),
    Mutation("cost_model_no_receive_time", "hetpipe_jax/planning/cost_model.py",
             "      t += float(self.recv_ms[prev_link][i])",
             "      t += 0.0",
             ("tests/test_cost_model.py", "tests/test_partitioner.py"),
             "a stage's time leaves out receiving its input activation"),
    # ---- engine
    Mutation("engine_backward_takes_forward_time", "hetpipe_jax/sim/engine.py",
             "      d, leg = gpu.dur_bwd, gpu.leg_bwd",
             "      d, leg = gpu.dur_fwd, gpu.leg_bwd",
             ("tests/test_engine.py",), "backward tasks last as long as forward tasks"),
    # ---- data
    Mutation("sharding_overlapping_shards", "hetpipe_jax/data/sharding.py",
             "  return permutation[shard_id * shard_size:(shard_id + 1) * shard_size].astype(np.int64)",
             "  return permutation[:shard_size].astype(np.int64)",
             ("tests/test_data.py",), "every VW gets the same shard"),
    Mutation("text_held_out_block_also_trained", "hetpipe_jax/data/text.py",
             "      held.append(block)\n",
             "      held.append(block)\n      run.append(block)\n",
             ("tests/test_text_lm.py::test_text_split_is_fixed_and_held_out_bytes_never_trained_on",),
             "the held-out blocks are also in the training text"),
    Mutation("user_dataset_shape_unchecked", "hetpipe_jax/data/dataset.py",
             "    if x.ndim < 1 or tuple(x.shape[1:]) != tuple(example_shape):",
             "    if x.ndim < 1:",
             ("tests/test_user_model_data.py::test_bad_model_or_dataset_is_one_config_error_naming_the_setting",),
             "a dataset whose examples do not fit the model is accepted (and fails later, inside training)"),
    Mutation("user_model_factory_result_unchecked", "hetpipe_jax/models/__init__.py",
             "  if not isinstance(spec, ModelSpec):",
             "  if False:",
             ("tests/test_user_model_data.py::test_bad_model_or_dataset_is_one_config_error_naming_the_setting",),
             "a user factory returning something other than a ModelSpec is accepted"),
    # ---- models
    Mutation("gpt_attention_not_causal", "hetpipe_jax/models/gpt.py",
             "    causal = jnp.tril(jnp.ones((s, s), bool))[None, None]",
             "    causal = jnp.ones((s, s), bool)[None, None]",
             ("tests/test_text_lm.py::test_causal_masking_later_tokens_do_not_change_earlier_logits",),
             "self-attention sees later tokens (the LM can read the byte it must predict)"),
    # ---- evaluation
    Mutation("bits_per_byte_in_nats", "hetpipe_jax/runtime/objectives.py",
             '  return {"test_bits_per_byte": test_loss / math.log(2.0)}',
             '  return {"test_bits_per_byte": test_loss}',
             ("tests/test_text_lm.py::test_next_token_evaluation_matches_a_numpy_reference_in_bits_per_byte",),
             "the LM's held-out loss is reported in nats under the name bits per byte"),
    Mutation("evaluation_counts_padding", "hetpipe_jax/jobs/evaluation.py",
             "      n += m\n",
             "      n += b\n",
             ("tests/test_references.py",), "the padded examples of the last evaluation batch are counted"),
    # ---- job: schedule, run length, staleness bound reached under MPI
    Mutation("cosine_schedule_too_long", "hetpipe_jax/jobs/mpi_job.py",
             "    lr = optax.cosine_decay_schedule(config.learning_rate, num_minibatches)",
             "    lr = optax.cosine_decay_schedule(config.learning_rate, 2 * num_minibatches)",
             ("tests/test_job_promises.py::test_learning_rate_schedule_follows_its_closed_form",),
             "the cosine schedule decays over twice the run, not over each VW's minibatches"),
    Mutation("run_length_not_whole_waves", "hetpipe_jax/jobs/mpi_job.py",
             "  total -= total % unit\n",
             "",
             ("tests/test_job_promises.py::test_minibatches_per_vw_rounds_down_to_whole_waves",),
             "a VW trains a partial last wave"),
    Mutation("wsp_forces_D_zero_in_the_vw", "hetpipe_jax/rules/wsp.py",
             "    if may_inject(self.local_clock, self.weights_global_clock, self.staleness_bound):\n"
             "      return True, None",
             "    if may_inject(self.local_clock, self.weights_global_clock, 0):\n"
             "      return True, None",
             ("tests/test_mpi_job.py::test_wsp_bound_holds_and_is_reached_with_three_vws",),
             "the VW's injection gate behaves as D = 0 whatever D is (BSP)"),
    # ---- job settings
    Mutation("settings_drop_nm_override", "hetpipe_jax/jobs/job_config.py",
             "  num_inflight = plan.num_inflight if given is None else given",
             "  num_inflight = plan.num_inflight",
             ("tests/test_job_config.py",), "a user's num_inflight is silently replaced by the plan's"),
    # ---- runtime host path (issue 10)
    Mutation("executor_times_from_pickup", "hetpipe_jax/runtime/stage_executor.py",
             "          start = submitted if submitted > device_free else device_free",
             "          start = picked",
             ("tests/test_stage_executor.py",),
             "an emulated task starts when the executor thread picks it up, not on the emulated device's timeline"),
    Mutation("runtime_hands_off_after_updates", "hetpipe_jax/runtime/vw_driver.py",
             _HANDOFF + _UPDATES, _UPDATES + _HANDOFF,
             ("tests/test_runtime_host_path.py::test_tasks_made_ready_start_before_the_minibatch_updates",),
             "tasks made ready by a completion the scheduler thread books wait until the completed minibatches' "
             "updates are applied"),
    Mutation("flush_accumulator_keeps_last_microbatch", "hetpipe_jax/runtime/flush_step.py",
             "    self.grad_acc[s] = st.add(self.grad_acc[s], grads)\n",
             "    self.grad_acc[s] = grads\n",
             ("tests/test_methods_runtime.py::test_flush_methods_in_one_vw_equal_single_device_training",),
             "a flush method's step keeps only each stage's last micro-batch gradients, not their sum"),
    Mutation("stage_completions_booked_out_of_order", "hetpipe_jax/runtime/vw_driver.py",
             "          if not routed[s] and not schedule.completes_minibatch(c.task):\n",
             "          if not schedule.completes_minibatch(c.task):\n",
             ("tests/test_runtime_host_path.py::test_tasks_made_ready_start_before_the_minibatch_updates",
              "tests/test_pipeline.py::test_oracle2_replay_of_recorded_versions"),
             "a stage's completion is booked on its executor while the stage's earlier one waits for the scheduler "
             "thread (booked out of the stage's order)"),
    Mutation("every_hop_through_the_scheduler", "hetpipe_jax/runtime/vw_driver.py",
             "    if c.error is None:\n      try:\n        with lock:\n          s = c.task.stage_id\n",
             "    if False:\n      try:\n        with lock:\n          s = c.task.stage_id\n",
             ("tests/test_runtime_host_path.py::test_a_hop_between_stages_does_not_wait_for_the_scheduler_thread",),
             "every completion goes through the scheduler thread (two wake-ups per cross-stage hop)"),
    Mutation("sharded_pull_ignores_shard_clocks", "hetpipe_jax/ps/shards.py",
             "    for c in wsp.own_waves_after_pull(keep, applied):  # this shard's slice lacks these own waves",
             "    for c in wsp.own_waves_after_pull(keep, min(own_applied)):",
             ("tests/test_ps_shards.py::test_pull_from_shards_at_different_clocks_equals_per_shard_replay",),
             "after a pull from shards at different clocks, own waves are re-added by the minimum clock on every "
             "shard (twice on shards that already hold them)"),
    Mutation("local_placement_is_round_robin", "hetpipe_jax/planning/ps_placement.py",
             '    elif policy == "default":\n      out.append(node_names[k % len(node_names)])',
             '    elif policy in ("default", "local"):\n      out.append(node_names[k % len(node_names)])',
             ("tests/test_ps_shards.py::test_runtime_placement_is_the_planners",),
             "the local parameter placement puts layers round-robin instead of on the node that runs them"),
    Mutation("shard_slice_lost_at_the_end", "hetpipe_jax/jobs/shard_ranks.py",
             "    shards.scatter(flat, shard, part)\n", "",
             ("tests/test_ps_shards.py::test_rank0_assembles_the_final_weights_from_every_shard",),
             "rank 0 saves W0 for the layers of the other shards instead of their final slices"),
    Mutation("pull_bytes_not_counted", "hetpipe_jax/ps/service.py",
             "        transport.PS_BYTES.add(dest, part.nbytes)\n", "",
             ("tests/test_ps_shards.py::test_served_pulls_are_counted_per_destination_rank",),
             "the transport does not count pulled weights in the PS bytes per rank pair"),
    Mutation("timing_plan_nm_unchecked", "hetpipe_jax/jobs/job_config.py",
             '            ("num_inflight", plan.num_inflight, settings.num_inflight),\n',
             '            ("num_inflight", plan.num_inflight, plan.num_inflight),\n',
             ("tests/test_timing_plan.py::test_a_timing_plan_that_does_not_describe_the_run_is_refused",),
             "a timing plan made for another Nm times the run (its schedule of versions is not the plan's)"),
    Mutation("timing_plan_drops_ps_times", "hetpipe_jax/jobs/job_config.py",
             "    return task_times.task_times_from_plan(plan, task_times.profile_for_plan(plan),\n"
             "                                           cluster_lib.load_cluster(plan.cluster))\n",
             "    return [dataclasses.replace(t, push_s=0.0, pull_s=0.0) for t in task_times.task_times_from_plan(\n"
             "        plan, task_times.profile_for_plan(plan), cluster_lib.load_cluster(plan.cluster))]\n",
             ("tests/test_timing_plan.py::test_timing_plan_gives_the_plans_own_task_times",),
             "the timing plan's task times lose the PS push and pull (a different schedule of versions)"),
    Mutation("allreduce_step_stamped_at_its_start", "hetpipe_jax/runtime/virtual_time.py",
             "    self._pending[step] = [len(self.vws), float(summed[-1]) / (len(self.vws) * "
             "self.vws[0].num_inflight)]\n",
             "    self._pending[step] = [len(self.vws), float(summed[-1]) / (len(self.vws) * "
             "self.vws[0].num_inflight)]\n"
             "    if self.on_step is not None:\n      self.on_step(step, t, self._pending[step][1])\n"
             "      self._pending[step][0] = -1\n",
             ("tests/test_paper_convergence.py::test_horovod_time_is_steps_times_slowest_replica_plus_allreduce",),
             "virtual time reports an all-reduce step (metrics, evaluation) when its reduction starts, before any "
             "replica holds the update"),
    # ---- stage ranks (issue 12)
    Mutation("stage_version_wait_skipped", "hetpipe_jax/runtime/stage_ranks.py",
             "      if version_id not in self._versions:\n        t = time.perf_counter()",
             "      if version_id not in self._versions:\n        return self._versions[self.latest]\n"
             "        t = time.perf_counter()",
             ("tests/test_stage_ranks.py::test_a_task_waits_until_its_version_has_been_applied",),
             "a stage rank runs a task whose weight version has not arrived on the latest version it holds"),
    Mutation("control_stream_sent_without_its_lock", "hetpipe_jax/runtime/stage_ranks.py",
             "    with self._send_lock:\n      self._sends.append((self.comm.Isend(header, dest=rank, tag=TAG_CONTROL)",
             "    if True:\n      self._sends.append((self.comm.Isend(header, dest=rank, tag=TAG_CONTROL)",
             ("tests/test_stage_ranks.py::test_control_messages_from_two_threads_arrive_whole",),
             "two threads' control messages interleave: a header lands in another message's payload buffer"),
    Mutation("clock_pair_keeps_first_reading", "hetpipe_jax/runtime/stage_executor.py",
             "    if best is None or b - a < best[0]:\n", "    if best is None:\n",
             ("tests/test_stage_executor.py::test_clock_pair_keeps_the_tightest_bracketed_reading",),
             "the run clock's pair is read once, however long the thread was away between its reads"),
    Mutation("stage_header_check_disabled", "hetpipe_jax/runtime/stage_wire.py",
             "  if wrong:\n", "  if False:\n",
             ("tests/test_stage_ranks.py::test_a_header_that_does_not_match_is_an_error_naming_both_ranks",
              "tests/test_stage_ranks.py::test_a_link_refuses_an_activation_whose_header_does_not_match"),
             "a stage-rank header with the wrong kind, VW, minibatch, stage, version or size is accepted"),
    Mutation("stage_pull_slice_without_own_waves", "hetpipe_jax/runtime/stage_ranks.py",
             "    local, self.own_flat = rebase_on_shards(flat, self.own_flat, [int(c) for c in own_applied], "
             "self.shard_index)\n",
             "    local = flat\n",
             ("tests/test_stage_ranks.py::test_stage_ranks_equal_the_replay_of_recorded_versions_with_lagging_pulls",),
             "after a pull, stage ranks' stages lack the VW's own pushed waves the PS has not applied yet"),
    Mutation("stage_wave_counted_before_all_parts", "hetpipe_jax/ps/shards.py",
             "    if len(got) < len(senders):\n      return None\n",
             "    if vw_parts.driver not in got:\n      return None\n",
             ("tests/test_ps_shards.py::test_stage_ranks_parts_and_a_wave_counted_once_all_parts_arrived",
              "tests/test_stage_ranks.py::test_stage_ranks_equal_the_replay_of_recorded_versions_with_lagging_pulls",
              "tests/test_stage_ranks.py::test_stage_ranks_train_exactly_as_one_process"),
             "a shard counts (and applies) a VW's wave once its driver's part arrived, before the stage ranks' parts"),
    Mutation("stage_rank_pushes_to_the_wrong_shard", "hetpipe_jax/ps/transport.py",
             "    isend(Kind.PUSH, wave_id, np.ascontiguousarray(values[index], np.float32), dest=shard)\n",
             "    isend(Kind.PUSH, wave_id, np.ascontiguousarray(values[index], np.float32),\n"
             "          dest=(shard + 1) % parts.num_shards if rank != parts.driver else shard)\n",
             ("tests/test_launch.py::test_stage_ranks_move_ps_bytes_between_their_own_nodes_and_shards",),
             "a stage rank pushes its part of a wave to another shard than the one holding those layers"),
    Mutation("stage_wave_delta_not_reset", "hetpipe_jax/runtime/minibatch_update.py",
             "    for s in vw.local_stages:\n      self.wave_delta[s] = vw.zeros[s]\n", "",
             ("tests/test_stage_ranks.py::test_stage_ranks_train_exactly_as_one_process",),
             "a stage rank's wave delta keeps the earlier waves' updates (each pushed again with every later wave)"),
    Mutation("stage_update_skipped_on_stage_ranks", "hetpipe_jax/runtime/minibatch_update.py",
             "    vw.placement.on_update(mb.record.minibatch_id, vw.version.version_id, norm)\n",
             "    if mb.record.minibatch_id % 2:\n"
             "      vw.placement.on_update(mb.record.minibatch_id, vw.version.version_id, norm)\n",
             ("tests/test_stage_ranks.py::test_stage_ranks_train_exactly_as_one_process",),
             "the driver does not send every minibatch's update to its stage ranks (their versions fall behind)"),
    # ---- paper reproduction (issue 13)
    Mutation("type_efficiency_ignored", "hetpipe_jax/planning/cost_model.py",
             "  if gpu.roofline_efficiency is not None:", "  if False:",
             ("tests/test_cost_model.py::test_per_type_roofline_efficiency_replaces_the_config_efficiencies",
              "tests/test_paper_experiments.py::test_calibration_recovers_known_efficiencies_from_horovod_rates"),
             "a GPU type's calibrated roofline efficiency is ignored (the config's 0.5 is used)"),
    Mutation("fixed_num_inflight_ignored", "hetpipe_jax/planning/allocator.py",
             "  if num_inflight > 0:\n    nm, total", "  if False:\n    nm, total",
             ("tests/test_paper_experiments.py::test_planner_fixes_hetpipe_num_inflight_or_says_why_not",),
             "the planner ignores a fixed hetpipe Nm and chooses its own"),
    Mutation("engine_nm_choice_keeps_the_first", "hetpipe_jax/sim/compare.py",
             "    if best is None or row.images_per_s > best[1].images_per_s * 1.001:",
             "    if best is None:",
             ("tests/test_paper_experiments.py::test_num_inflight_chosen_by_the_engine_is_the_fastest_engine_run",),
             "choose_num_inflight_by_engine keeps Nm = 1 instead of the fastest engine run"),
    Mutation("compare_ignores_nm_by_engine", "hetpipe_jax/sim/compare.py",
             "      if config.num_inflight_by_engine and method == \"hetpipe\"",
             "      if False and method == \"hetpipe\"",
             ("tests/test_paper_experiments.py::test_compare_with_nm_by_engine_is_never_slower_than_the_planners_nm",),
             "compare --num_inflight_by_engine silently keeps the planner's closed-form Nm"),
    Mutation("jitter_also_on_sends", "hetpipe_jax/sim/engine.py",
             "      d += (gpu.comp_bwd if task.kind is _BACKWARD else gpu.comp_fwd) * (draw(mu, sigma) - 1.0)",
             "      d *= draw(mu, sigma)",
             ("tests/test_engine_jitter.py",), "the task-time jitter also stretches the output's send"),
    Mutation("jitter_mean_not_one", "hetpipe_jax/sim/engine.py",
             "      self._jitter = (random.Random(config.jitter_seed).lognormvariate, -0.5 * sigma * sigma, sigma)",
             "      self._jitter = (random.Random(config.jitter_seed).lognormvariate, 0.0, sigma)",
             ("tests/test_engine_jitter.py",), "the log-normal jitter factor's mean is exp(sigma^2 / 2), not 1"),
    Mutation("jitter_cv_is_sigma", "hetpipe_jax/sim/engine.py",
             "      sigma = math.sqrt(math.log1p(config.task_time_cv ** 2))",
             "      sigma = config.task_time_cv * 0.5",
             ("tests/test_engine_jitter.py",), "the jitter's coefficient of variation is not the one set"),
    Mutation("memory_cap_not_enforced", "hetpipe_jax/rules/schedule.py",
             "    if queue[0].kind is not _FORWARD or self._held[stage_id] < self.max_held[stage_id]:",
             "    if True:",
             ("tests/test_memory_caps.py",), "a forward starts on a stage already holding its memory cap"),
    Mutation("memory_cap_blocks_backwards", "hetpipe_jax/rules/schedule.py",
             "      if task.kind is _BACKWARD:\n        return i",
             "      if False:\n        return i",
             ("tests/test_memory_caps.py::test_a_held_back_forward_lets_the_ready_backward_pass",
              "tests/test_memory_caps.py::test_random_instances_complete_within_their_caps"),
             "a held-back forward blocks the backward behind it (FIFO kept strictly: the pipeline deadlocks)"),
    Mutation("virtual_job_drops_memory_caps", "hetpipe_jax/jobs/mpi_job.py",
             "max_held=settings.memory_caps[vw_id] if settings.memory_caps else None, **options)",
             "max_held=None, **options)",
             ("tests/test_memory_caps.py::test_virtual_job_from_a_schedule_plan_records_and_enforces_its_caps",),
             "virtual time records a schedule plan's caps but does not enforce them"),
    Mutation("memory_caps_at_any_nm", "hetpipe_jax/planning/plan_format.py",
             "      or num_inflight != plan.num_inflight or any(",
             "      or any(",
             ("tests/test_memory_caps.py::test_memory_caps_come_from_schedule_plans_at_their_nm",),
             "caps counted at the plan's Nm are applied to a run at another Nm"),
    # issue 23 defects 1, 3, 4, 5, 6 (README launch and device index, method settings, world-size fix, slots, shards)
    Mutation("gpu_index_no_node_default", "hetpipe_jax/planning/cluster.py",
             "    return self.local_devices.get(gpu_id, node_local_index(gpu_id))",
             "    return self.local_devices.get(gpu_id)",
             ("tests/test_launch.py::test_a_gpus_device_index_defaults_to_its_index_on_its_node",),
             "a GPU the cluster file does not map gets no device index (the README's launch stops)"),
    Mutation("cluster_local_devices_ignored", "hetpipe_jax/planning/cluster.py",
             "    return self.local_devices.get(gpu_id, node_local_index(gpu_id))",
             "    return node_local_index(gpu_id)",
             ("tests/test_launch.py::test_a_gpus_device_index_defaults_to_its_index_on_its_node",),
             "the cluster file's local_devices no longer overrides a GPU's index on its node"),
    Mutation("hostfile_slots_ignored", "hetpipe_jax/planning/rank_map.py",
             "    if have is not None and len(on_host) > have:",
             "    if False:",
             ("tests/test_launch.py::test_hostfile_slots_limit_the_ranks_on_each_host_unless_oversubscribed",),
             "a host gets more ranks than its hostfile slots without --oversubscribe"),

    Mutation("allreduce_accepts_ps_shards", "hetpipe_jax/jobs/job_config.py",
             '    MethodSetting("num_ps_shards", None, _PS_METHODS, "sets the parameter-server shards"),',
             '    MethodSetting("num_ps_shards", None, methods.METHODS, "sets the parameter-server shards"),',
             ("tests/test_job_config.py::test_every_method_refuses_the_settings_it_does_not_use",),
             "gpipe, 1f1b_flush and horovod accept num_ps_shards, run without a PS and record it"),
    Mutation("world_size_suggests_negative_vws", "hetpipe_jax/jobs/job_config.py",
             "if settings.plan is None and not settings.num_stage_ranks and fits >= 1 and not per_vw else",
             "if settings.plan is None and not settings.num_stage_ranks and not per_vw else",
             ("tests/test_job_config.py::test_the_world_size_error_suggests_only_fixes_that_work",),
             "the world-size error suggests a VW count below 1"),

    Mutation("empty_ps_shard_runs", "hetpipe_jax/jobs/job_config.py",
             '  if empty and settings.ps_placement != "local":',
             "  if False:",
             ("tests/test_ps_shards.py::test_a_shard_without_parameters_is_refused_under_default_placement",),
             "a PS shard left without parameters (more shards than parameterised layers) runs silently"),

    Mutation("hostfile_slots_not_summed", "hetpipe_jax/planning/rank_map.py",
             "    slots[host] = slots.get(host, 0) + (int(count) if colon else 1)",
             "    slots[host] = int(count) if colon else 1",
             ("tests/test_launch.py::test_hostfile_slots_limit_the_ranks_on_each_host_unless_oversubscribed",
              "tests/test_launch.py::test_a_gpus_device_index_defaults_to_its_index_on_its_node"),
             "a host on several hostfile lines gets only its last line's slots (four localhost:5 lines: 5, not 20)"),
    Mutation("readme_launch_without_gpu_index", "hetpipe_jax/planning/cluster.py",
             "    return self.local_devices.get(gpu_id, node_local_index(gpu_id))",
             "    return self.local_devices.get(gpu_id)",
             ("tests/test_readme.py::test_readme_commands_run_as_written",),
             "the README's plan-then-launch example stops (the README test runs it as written)"),
    # ---- issue 23, behaviour no test checked (direct tests of each gap)
    Mutation("sharded_rebase_prunes_by_the_newest_shard", "hetpipe_jax/ps/shards.py",
             "  return local, {c: own_flat[c] for c in keep}",
             "  return local, {c: own_flat[c] for c in keep if c >= max(own_applied)}",
             ("tests/test_ps_shards.py::test_own_waves_survive_a_shard_lagging_behind_two_pulls_in_a_row",),
             "after a sharded pull the VW keeps only the own waves the most advanced shard lacks: a wave a lagging "
             "shard still lacks at the next pull is lost there"),
    Mutation("ps_pull_answered_with_live_weights", "hetpipe_jax/ps/param_server.py",
             "    return self.state.vector_clock(), self.weights.copy()",
             "    return self.state.vector_clock(), self.weights",
             ("tests/test_wsp.py::test_a_snapshot_is_a_copy_that_later_pushes_leave_unchanged",
              "tests/test_methods_runtime.py::test_pipedream_with_two_vws_and_pulls_equals_an_event_order_replay"),
             "a pull is answered with the live global weights, so pushes applied before the VW installs it leak in"),
    Mutation("ps_reply_sends_the_live_weights", "hetpipe_jax/ps/service.py",
             "      vector_clock, weights = self.server.snapshot()\n",
             "      vector_clock, weights = self.server.state.vector_clock(), self.server.weights\n",
             ("tests/test_ps_shards.py::test_a_pull_reply_carries_the_weights_as_answered_while_later_pushes_land",),
             "the PS service sends the live global weights as a pull's reply; pushes applied before the send "
             "completes change what the VW receives"),
    Mutation("sharded_pull_clock_is_the_max_over_shards", "hetpipe_jax/ps/transport.py",
             "    vector_clock = tuple(min(vc[v] for vc in per_shard) for v in range(self.num_virtual_workers))",
             "    vector_clock = tuple(max(vc[v] for vc in per_shard) for v in range(self.num_virtual_workers))",
             ("tests/test_ps_shards.py::test_a_sharded_pull_holds_the_element_wise_minimum_of_its_shards_vector_clocks",),
             "a sharded pull's vector clock is the most advanced shard's, not what every layer holds"),
    Mutation("sharded_pull_clock_is_the_lead_shards", "hetpipe_jax/ps/transport.py",
             "    vector_clock = tuple(min(vc[v] for vc in per_shard) for v in range(self.num_virtual_workers))",
             "    vector_clock = per_shard[0]",
             ("tests/test_ps_shards.py::test_a_sharded_pull_holds_the_element_wise_minimum_of_its_shards_vector_clocks",),
             "a sharded pull's vector clock is the lead shard's (rank 0), not the minimum over shards"),

    Mutation("partition_mid_stage_memory_strict", "hetpipe_jax/planning/partitioner.py",
             "    by_count[h] = ([np.where(mem_mid <= cap, comp, np.inf)",
             "    by_count[h] = ([np.where(mem_mid < cap, comp, np.inf)",
             ("tests/test_partitioner.py::test_a_stage_needing_exactly_the_usable_memory_fits",),
             "a non-last stage needing exactly its GPU's usable memory is taken not to fit"),
    Mutation("partition_last_stage_memory_strict", "hetpipe_jax/planning/partitioner.py",
             "  last = [np.where(mem_last <= cap, comp, np.inf)",
             "  last = [np.where(mem_last < cap, comp, np.inf)",
             ("tests/test_partitioner.py::test_a_stage_needing_exactly_the_usable_memory_fits",),
             "the last stage needing exactly its GPU's usable memory is taken not to fit"),
    Mutation("partition_fits_strict", "hetpipe_jax/planning/partitioner.py",
             "    return all(m <= c for m, c in zip(self.stage_memory_bytes, self.capacity_bytes))",
             "    return all(m < c for m, c in zip(self.stage_memory_bytes, self.capacity_bytes))",
             ("tests/test_partitioner.py::test_a_stage_needing_exactly_the_usable_memory_fits",),
             "a partition whose stage needs exactly the usable memory is reported as not fitting"),

    Mutation("auto_vw_sizes_below_max_vw_gpus", "hetpipe_jax/planning/auto_allocation.py",
             "                    if min_size <= sum(n) <= self.max_size]",
             "                    if min_size <= sum(n) < self.max_size]",
             ("tests/test_allocator.py::test_auto_searches_virtual_workers_of_exactly_max_vw_gpus",),
             "auto never builds a VW of exactly max_vw_gpus GPUs"),
    Mutation("auto_next_vw_below_max_vw_gpus", "hetpipe_jax/planning/auto_allocation.py",
             "    hi = min(self.max_size, total - (k - 1))",
             "    hi = min(self.max_size - 1, total - (k - 1))",
             ("tests/test_allocator.py::test_auto_searches_virtual_workers_of_exactly_max_vw_gpus",),
             "auto's split search gives the next VW at most max_vw_gpus - 1 GPUs"),

    Mutation("engine_pull_request_before_the_push", "hetpipe_jax/sim/engine.py",
             "    if wave is not None:\n      hook = self._on_wave_end\n      if hook is not None:\n"
             "        hook(vw.vw_id, wave, t)\n      vw.num_pushes += 1\n",
             "    if pull is not None:\n      self._request_pull(vw, pull, t)\n      pull = None\n"
             "    if wave is not None:\n      hook = self._on_wave_end\n      if hook is not None:\n"
             "        hook(vw.vw_id, wave, t)\n      vw.num_pushes += 1\n",
             ("tests/test_engine.py::test_a_vw_pull_request_never_overtakes_its_own_push",),
             "at a wave end the engine sends the VW's pull request before its push, so the reply lacks the wave"),
    Mutation("engine_pull_request_ignores_the_push_in_flight", "hetpipe_jax/sim/engine.py",
             "    self._push_event(max(t, vw.last_push_arrival), _PULL_REQUEST, vw.vw_id, required)",
             "    self._push_event(t, _PULL_REQUEST, vw.vw_id, required)",
             ("tests/test_engine.py::test_a_vw_pull_request_never_overtakes_its_own_push",),
             "a pull request reaches the PS before the VW's push sent just before it (no ordered channel)"),

    Mutation("flush_loss_averaged_over_one_vw", "hetpipe_jax/runtime/flush_step.py",
             "      self.on_step(step, float(summed[-1]) / count)",
             "      self.on_step(step, float(summed[-1]) / vw.num_inflight)",
             ("tests/test_methods_runtime.py::test_flush_methods_with_two_vws_report_the_mean_loss_over_every_micro_batch",),
             "the flush methods report a step's loss summed over the VWs (averaged over one VW's micro-batches)"),

    Mutation("mpi_resume_skips_optimizer_state", "hetpipe_jax/jobs/mpi_job.py",
             "    vw.load_opt_state(*point.opt_states[vw_id])\n",
             "    pass\n",
             ("tests/test_resume_mpi.py::test_kill_a_vw_after_a_checkpoint_then_resume_to_the_end",),
             "a VW resumed under MPI starts with a fresh optimizer state (momentum restarts at zero)"),

    Mutation("pipedream_pull_forgets_own_waves", "hetpipe_jax/runtime/pipedream_updates.py",
             "      for c in keep:\n        p = st.add(p, self.own_waves[c][s])\n",
             "",
             ("tests/test_methods_runtime.py::test_pipedream_with_two_vws_and_pulls_equals_an_event_order_replay",),
             "PipeDream's pull drops the VW's own pushed waves the pulled weights do not hold yet"),
    Mutation("pipedream_pull_drops_unpushed_deltas", "hetpipe_jax/runtime/pipedream_updates.py",
             "        for _, d in sorted(self.stage_wave_delta[s].items()):\n          p = st.add(p, d)\n",
             "        pass\n",
             ("tests/test_methods_runtime.py::test_pipedream_with_two_vws_and_pulls_equals_an_event_order_replay",),
             "PipeDream's pull drops each stage's updates of waves not pushed yet"),
    Mutation("pipedream_pull_leaves_stashed_versions", "hetpipe_jax/runtime/pipedream_updates.py",
             "        if self.vertical_sync:\n          correction = ",
             "        if False:\n          correction = ",
             ("tests/test_methods_runtime.py::test_pipedream_with_two_vws_and_pulls_equals_an_event_order_replay",),
             "with vertical sync, a pull rebases each stage's latest weights but not its kept older versions"),
    Mutation("pipedream_pull_rebases_stage_zero_only", "hetpipe_jax/runtime/pipedream_updates.py",
             "    for s, st in enumerate(vw.stages):\n      p = vw.stage_params_of(s, flat)\n",
             "    for s, st in enumerate(vw.stages[:1]):\n      p = vw.stage_params_of(s, flat)\n",
             ("tests/test_methods_runtime.py::test_pipedream_with_two_vws_and_pulls_equals_an_event_order_replay",),
             "PipeDream's pull installs the pulled weights on stage 0 only"),

    # ---- issue 23: global-norm clipping, diverged replicas fail, replayable runs (wt_b)
    Mutation("grad_clip_by_each_stage_norm", "hetpipe_jax/runtime/stages.py",
             "    return grad_clip.clip(grads, norm, max_norm) if max_norm > 0 else grads\n",
             "    return grad_clip.clip(grads, jnp.sqrt(grad_clip.stage_sq_norm(grads)), max_norm) if max_norm > 0 else grads\n",
             ("tests/test_global_clip.py::test_pipelines_clip_by_the_global_norm_whatever_the_partition",
              "tests/test_global_clip.py::test_flush_methods_clip_the_mean_gradient_by_its_global_norm"),
             "grad_clip_norm clips each stage's gradient by its own norm (the numerics depend on the partition)"),
    Mutation("stage_rank_sq_norm_not_reported", "hetpipe_jax/runtime/stage_ranks.py",
             "      sq_norm = float(jax.device_get(self.vw.stages[s].sq_norm(",
             "      sq_norm = 0.0 * float(jax.device_get(self.vw.stages[s].sq_norm(",
             ("tests/test_stage_ranks.py::test_stage_ranks_clip_by_the_global_norm_over_every_rank",),
             "a stage rank reports no squared norm: the driver clips by the norm of its own stages only"),
    Mutation("diverged_replicas_pass", "hetpipe_jax/jobs/outputs.py",
             "  if len(groups) > 1:\n    shown", "  if False:\n    shown",
             ("tests/test_global_clip.py::test_virtual_time_replicas_that_diverge_fail_the_run",
              "tests/test_global_clip.py::test_mpi_replicas_that_diverge_exit_non_zero_with_an_error"),
             "an all-reduce run whose replicas ended with different weights finishes with exit 0"),
    Mutation("recorded_example_ids_of_another_minibatch", "hetpipe_jax/data/sharding.py",
             "    return self._images[idx], self._labels[idx], idx\n",
             "    return self._images[idx], self._labels[idx], self.indices(minibatch_id + 1)\n",
             ("tests/test_replayable_runs.py::test_a_virtual_time_run_replays_from_its_outputs_alone",),
             "minibatches.jsonl's example_ids are not the examples the minibatch trained on"),
    Mutation("initial_weights_hash_of_other_weights", "hetpipe_jax/jobs/mpi_job.py",
             "\"initial_weights_sha256\": weights_sha256(flat0),",
             "\"initial_weights_sha256\": weights_sha256(flat0[::-1]),",
             ("tests/test_replayable_runs.py::test_a_virtual_time_run_replays_from_its_outputs_alone",),
             "config.json's initial weights' hash is not the hash of the weights the run started from"),
    # issue 28: the memory model against the paper's Horovod facts
    Mutation("workspace_counts_no_freed_stash", "hetpipe_jax/planning/cost_model.py",
             "    out[i, i + 1:] = np.maximum.accumulate(reach[i:]) - stash_prefix[i + 1:]",
             "    out[i, i + 1:] = np.maximum.accumulate(ws[i:])",
             ("tests/test_memory_facts.py::test_workspace_beyond_stash_matches_a_liveness_replay",
              "tests/test_memory_facts.py::test_horovod_whole_model_fits_where_the_paper_ran_it",
              "tests/test_cost_model.py::test_stage_memory_formula"),
             "a layer's temporaries are added on top of the whole stash (none reuses the freed residuals)"),
    Mutation("workspace_without_activation_gradients", "hetpipe_jax/planning/cost_model.py",
             "          [l.workspace_bytes + b + l.output_activation_bytes for l, b in zip(layers, bbytes)], stash),",
             "          [l.workspace_bytes for l, b in zip(layers, bbytes)], stash),",
             ("tests/test_cost_model.py::test_stage_memory_formula",),
             "the backward's activation gradients (received and produced by a layer) are not counted"),
    Mutation("xla_stage_peak_without_resident_state", "hetpipe_jax/runtime/xla_memory.py",
             "  peak = max(pm.total_bytes + (0 if name == \"update\" else resident) for name, pm in programs.items())",
             "  peak = max(pm.total_bytes for name, pm in programs.items())",
             ("tests/test_xla_memory.py::test_stage_memory_reads_the_stage_programs",),
             "XLA's stage peak leaves out the optimizer state and accumulator outside the forward/backward's arguments"),
    Mutation("profiler_records_no_xla_temp", "hetpipe_jax/runtime/profiler.py",
             "          workspace_bytes=max(_temp_bytes(fwd_c), _temp_bytes(bwd_c)))",
             "          workspace_bytes=0)",
             ("tests/test_xla_memory.py::test_cost_model_within_20_percent_of_xla_on_two_stages",),
             "the profiler records no XLA temporaries: the cost model falls below XLA's own accounting"),
    Mutation("relu_keeps_a_float_mask", "hetpipe_jax/models/layers.py",
             "  return jnp.maximum(x, 0), x > 0",
             "  return jnp.maximum(x, 0), (x > 0).astype(x.dtype)",
             ("tests/test_memory_facts.py::test_relu_keeps_only_a_mask_and_matches_flax_relu",),
             "the ReLU keeps a full-size float32 mask for its backward instead of a 1-byte one"),
    Mutation("bottleneck_tail_not_rematerialised", "hetpipe_jax/models/imagenet.py",
             "    return nn.remat(NormAddReLU)(project)(y, x)",
             "    return NormAddReLU(project)(y, x)",
             ("tests/test_memory_facts.py::test_bottleneck_keeps_what_fused_batch_norm_keeps",),
             "the bottleneck's last GroupNorm + add + ReLU keeps autodiff's residuals, not only its inputs"),
    Mutation("conv_relu_keeps_flax_zeros", "hetpipe_jax/models/layers.py",
             "    return relu(nn.Conv(self.features, self.kernel_size, self.strides, padding=\"SAME\")(x))",
             "    return nn.relu(nn.Conv(self.features, self.kernel_size, self.strides, padding=\"SAME\")(x))",
             ("tests/test_memory_facts.py::test_saved_paper_profiles_hold_what_the_models_keep",),
             "VGG-19's conv layers use flax's relu again (its backward keeps a float32 zeros array): the saved "
             "profiles no longer hold what the model keeps"),
    # issue 25 item 1: optimizers made for delay (nadam, nadamw, b1 up to 0.99, muon per stage).
    Mutation("muon_takes_the_head", "hetpipe_jax/runtime/optimizers.py",
             "MuonDimensionNumbers(0, 1) if i != output_layer and _is_muon_leaf(path, leaf) else None",
             "MuonDimensionNumbers(0, 1) if _is_muon_leaf(path, leaf) else None",
             ("tests/test_optimizers.py::test_muon_rule_picks_the_hand_listed_hidden_matrices",),
             "Muon orthogonalizes the output layer's kernel (the head) too"),
    Mutation("muon_takes_conv_kernels", "hetpipe_jax/runtime/optimizers.py",
             'return getattr(last, "key", None) == "kernel" and len(leaf.shape) == 2',
             'return getattr(last, "key", None) == "kernel" and len(leaf.shape) >= 2',
             ("tests/test_optimizers.py::test_muon_rule_picks_the_hand_listed_hidden_matrices",),
             "Muon takes 4-D convolution kernels as well as Dense matrices"),
    Mutation("muon_stage_takes_first_layers_rule", "hetpipe_jax/jobs/mpi_job.py",
             "muon_weight_dimension_numbers=dims[start:end]", "muon_weight_dimension_numbers=dims[:end - start]",
             ("tests/test_optimizers.py::test_each_stage_gives_muon_the_same_leaves_whichever_stage_holds_them",),
             "a stage applies the rule of the model's first layers to its own (a layer's rule depends on its stage)"),
    Mutation("stage_builds_another_stages_optimizer", "hetpipe_jax/runtime/stages.py",
             "optimizers.for_layers(optimizer, start, end), loss_fn, remat)",
             "optimizers.for_layers(optimizer, 0, end - start), loss_fn, remat)",
             ("tests/test_optimizers.py::test_pipelined_vw_equals_whole_model_optax",),
             "each stage's jitted update uses the transformation of the model's first layers"),
    Mutation("nadam_is_adam", "hetpipe_jax/jobs/mpi_job.py",
             "tx = optax.nadam(lr, b1=b1, b2=b2)", "tx = optax.adam(lr, b1=b1, b2=b2)",
             ("tests/test_optimizers.py::test_pipelined_vw_equals_whole_model_optax",),
             "config.optimizer='nadam' runs Adam without Nesterov momentum"),
    Mutation("nadamw_drops_weight_decay", "hetpipe_jax/jobs/mpi_job.py",
             "tx = optax.nadamw(lr, b1=b1, b2=b2, weight_decay=decay)",
             "tx = optax.nadamw(lr, b1=b1, b2=b2, weight_decay=0.0)",
             ("tests/test_optimizers.py::test_pipelined_vw_equals_whole_model_optax",),
             "nadamw runs without the recorded config.weight_decay"),
    Mutation("muon_adam_part_ignores_b1", "hetpipe_jax/jobs/mpi_job.py",
             "weight_decay=decay, adam_b1=b1, adam_b2=b2,", "weight_decay=decay, adam_b2=b2,",
             ("tests/test_optimizers.py::test_pipelined_vw_equals_whole_model_optax",),
             "Muon's Adam part (embeddings, head, norms, biases) runs optax's b1 = 0.9, not config.adam_b1"),
    Mutation("muon_beta_ignored", "hetpipe_jax/jobs/mpi_job.py",
             'beta=config.get("muon_beta", 0.95)', "beta=0.95",
             ("tests/test_optimizers.py::test_pipelined_vw_equals_whole_model_optax",),
             "config.muon_beta is recorded but Muon runs its default momentum"),
    Mutation("opt_state_masked_parts_as_scalars", "hetpipe_jax/runtime/opt_state.py",
             "jax.tree.structure(part, is_leaf=_is_masked) == want", "jax.tree.structure(part) == want",
             ("tests/test_optimizers.py::test_muon_state_moves_to_another_partition_through_a_checkpoint",),
             "Muon's per-layer state (with optax MaskedNode parts) is split as shared scalars, so it cannot move "
             "to another partition"),
    Mutation("opt_state_joined_by_structure", "hetpipe_jax/runtime/opt_state.py",
             "        if _leaf_shapes(want) != _leaf_shapes(got):",
             "        if jax.tree.structure(want) != jax.tree.structure(got):",
             ("tests/test_optimizers.py::test_muon_state_moves_to_another_partition_through_a_checkpoint",),
             "a checkpoint's Muon state (orbax restores a MaskedNode part as None) no longer loads"),
    Mutation("adam_b1_of_one_accepted", "hetpipe_jax/jobs/job_config.py",
             "    if not 0 <= value < 1:", "    if not 0 <= value <= 1:",
             ("tests/test_optimizers.py::test_bad_optimizer_settings_are_one_error_each",),
             "adam_b1 = 1 (a mean that never moves) is accepted"),
    Mutation("negative_weight_decay_accepted", "hetpipe_jax/jobs/job_config.py",
             "  if not decay >= 0:", "  if False:",
             ("tests/test_optimizers.py::test_bad_optimizer_settings_are_one_error_each",),
             "nadamw runs with a negative weight decay (weights grow)"),
    Mutation("weight_decay_ignored_by_adam", "hetpipe_jax/jobs/job_config.py",
             "    if value != default and config.optimizer not in users:",
             '    if value != default and config.optimizer not in users + ("adam",):',
             ("tests/test_optimizers.py::test_bad_optimizer_settings_are_one_error_each",),
             "config.weight_decay with adam is recorded but not used (adam has none)"),
    Mutation("muon_refused_after_outputs", "hetpipe_jax/jobs/mpi_job.py",
             '  if config.optimizer == "muon":\n    _muon_layer_shapes(config, spec)\n',
             "",
             ("tests/test_optimizers.py::test_muon_for_a_model_without_hidden_matrices_stops_before_any_output",),
             "muon for a model without hidden matrices fails only when the optimizer is built, after config.json "
             "(and, under MPI, after the barrier: PS shard ranks would wait forever)"),
    Mutation("summary_omits_muon_params", "hetpipe_jax/jobs/outputs.py",
             '    optimizer["muon_params"] = optimizers.muon_leaf_names(shapes)', "    pass",
             ("tests/test_optimizers.py::test_every_method_in_virtual_time_equals_whole_model_optax",),
             "summary.json does not say which leaves Muon orthogonalized"),
    Mutation("summary_drops_optimizer_settings", "hetpipe_jax/jobs/job_config.py",
             "          if config.optimizer in users}", "          if False}",
             ("tests/test_optimizers.py::test_every_method_in_virtual_time_equals_whole_model_optax",),
             "summary.json's optimizer lacks the settings it ran with (b1, b2, weight decay, Muon's beta)"),
    # ---- issue 28: a device holding several stages; the wave path's one buffer per stage each way
    Mutation("stage_devices_must_be_distinct_again", "hetpipe_jax/jobs/job_config.py",
             "  if min(devices) < 0:\n",
             "  if min(devices) < 0 or len(set(devices)) != len(devices):\n",
             ("tests/test_job_config.py::test_a_device_may_hold_several_stages",),
             "two stages may not share a device: one GPU cannot run a VW (the GPU check's main job)"),
    Mutation("unravel_reads_every_leaf_from_the_start", "hetpipe_jax/runtime/stages.py",
             "    pos += leaf.size\n",
             "    pos += 0\n",
             ("tests/test_pipeline.py::test_pull_installed_mid_wave_keeps_own_and_partial_waves",),
             "a pulled stage's buffer is cut up wrongly on the device: every leaf starts at the buffer's first float"),
    Mutation("wave_flat_in_reverse_stage_order", "hetpipe_jax/runtime/virtual_worker.py",
             "    return np.concatenate(parts) if parts else np.zeros(0, np.float32)",
             "    return np.concatenate(parts[::-1]) if parts else np.zeros(0, np.float32)",
             ("tests/test_pipeline.py::test_pull_installed_mid_wave_keeps_own_and_partial_waves",),
             "a wave's update is pushed with the stages' parts in reverse order (a layout the PS does not hold)"),

    # ---- issue 26: fsdp (ZeRO-3 / FSDP) in the cost model, the engine and compare (wt_f)
    Mutation("fsdp_allreduce_not_allgather", "hetpipe_jax/planning/fsdp_cost.py",
             "  ag = np.array([0.5 * allreduce_cost.ring_groups_time_s([(pad * p, gpus)], cluster, True) for p in params])",
             "  ag = np.array([1.0 * allreduce_cost.ring_groups_time_s([(pad * p, gpus)], cluster, True) for p in params])",
             ("tests/test_fsdp.py::test_zero3_communication_time_and_step_closed_form",),
             "an all-gather costs a whole ring all-reduce instead of half of one"),
    Mutation("fsdp_no_overlap_in_backward", "hetpipe_jax/planning/fsdp_cost.py",
             "np.sum(np.maximum(b_l, 2 * a))", "np.sum(b_l + 2 * a)",
             ("tests/test_fsdp.py::test_zero3_communication_time_and_step_closed_form",),
             "the backward's gathers and reduce-scatters are not overlapped with its compute"),
    Mutation("fsdp_bytes_two_collectives", "hetpipe_jax/planning/fsdp_cost.py",
             "      bytes_sent_per_gpu=3.0 * (n - 1) / n", "      bytes_sent_per_gpu=2.0 * (n - 1) / n",
             ("tests/test_fsdp.py::test_zero3_communication_time_and_step_closed_form",),
             "the communication volume leaves out the backward's all-gather"),
    Mutation("fsdp_unpadded_shards", "hetpipe_jax/planning/fsdp_cost.py",
             "  pad = n * max(shards)", "  pad = 1.0",
             ("tests/test_fsdp.py::test_uneven_shards_pad_the_collectives",),
             "uneven shards are gathered as if even (no padding to the largest shard)"),
    Mutation("fsdp_full_state_per_gpu", "hetpipe_jax/planning/fsdp_cost.py",
             "  memory = [f * state + gathered + b * act", "  memory = [state + gathered + b * act",
             ("tests/test_fsdp.py::test_memory_per_gpu_by_hand",),
             "every GPU holds the whole state (nothing is sharded)"),
    Mutation("fsdp_one_gathered_layer", "hetpipe_jax/planning/fsdp_cost.py",
             "  return 3.0 * max((l.param_bytes", "  return 1.0 * max((l.param_bytes",
             ("tests/test_fsdp.py::test_memory_per_gpu_by_hand",),
             "memory counts one gathered layer, not the prefetched one and the unsharded gradient"),
    Mutation("fsdp_remat_no_recompute", "hetpipe_jax/planning/fsdp_cost.py",
             "    bwd = bwd + fwd  # each backward", "    bwd = bwd + 0 * fwd  # each backward",
             ("tests/test_fsdp.py::test_memory_per_gpu_by_hand",),
             "activation checkpointing saves memory but costs no recomputation"),
    Mutation("fsdp_split_ignores_memory_caps", "hetpipe_jax/planning/fsdp_cost.py",
             "    if b[g] < caps[g]:\n", "    if True:\n",
             ("tests/test_fsdp.py::test_split_examples_against_brute_force",
              "tests/test_fsdp.py::test_hetero_examples_by_speed_within_memory"),
             "the speed split gives a GPU more examples than its memory holds"),
    Mutation("fsdp_split_by_count_not_time", "hetpipe_jax/planning/fsdp_cost.py",
             "      heapq.heappush(heap, ((b[g] + 1) * per_example_s[g], g))",
             "      heapq.heappush(heap, ((b[g] + 1), g))",
             ("tests/test_fsdp.py::test_split_examples_against_brute_force",
              "tests/test_fsdp.py::test_hetero_examples_by_speed_within_memory"),
             "examples are split evenly, whatever the GPUs' speeds"),
    Mutation("fsdp_shards_proportional_to_room", "hetpipe_jax/planning/fsdp_cost.py",
             "  f = np.minimum(hi, room)\n", "  f = room.copy()\n",
             ("tests/test_fsdp.py::test_hetero_shards_by_memory_against_a_grid",),
             "shards proportional to free memory: larger shards (padded collectives) than needed"),
    Mutation("fsdp_engine_no_exposed_comm", "hetpipe_jax/sim/task_times.py",
             "                      push_s=0.0, pull_s=0.0, allreduce_s=free, stage_nodes=(g.node,),\n"
             "                      allreduce_shared_nic_s=exposed)",
             "                      push_s=0.0, pull_s=0.0, allreduce_s=0.0, stage_nodes=(g.node,),\n"
             "                      allreduce_shared_nic_s=0.0)",
             ("tests/test_fsdp.py::test_engine_step_equals_the_closed_form_on_a_homogeneous_cluster",),
             "the engine runs fsdp's compute without its collectives"),
    Mutation("fsdp_rows_left_out_of_compare", "hetpipe_jax/sim/compare.py",
             "  for variant in fsdp_cost.VARIANTS:\n", "  for variant in ():\n",
             ("tests/test_fsdp.py::test_compare_lists_both_fsdp_variants",),
             "compare lists no fsdp row"),
    Mutation("fsdp_runs_in_the_harness", "hetpipe_jax/rules/methods.py",
             "HARNESS_METHODS = tuple(m for m in METHODS if not _TABLE[m].sharded)", "HARNESS_METHODS = METHODS",
             ("tests/test_job_config.py::test_bad_settings_name_the_setting",),
             "config.method=fsdp is accepted by hetpipe_jax.train, which has no fsdp runtime"),
    Mutation("fsdp_runtime_replicates_state", "hetpipe_jax/runtime/fsdp_step.py",
             "    if size >= n and size % n == 0:\n", "    if False:\n",
             ("tests/test_fsdp.py::test_fsdp_validate_quick_end_to_end",),
             "the one-host runtime replicates parameters and optimizer state instead of sharding them"),
    Mutation("fsdp_runtime_half_batch", "hetpipe_jax/runtime/fsdp_step.py",
             "      value, grads = jax.value_and_grad(loss)(params, x, y)",
             "      value, grads = jax.value_and_grad(loss)(params, x[: x.shape[0] // 2], y[: y.shape[0] // 2])",
             ("tests/test_fsdp.py::test_fsdp_validate_quick_end_to_end",),
             "the sharded step's gradient is one device's share of the batch, not the global mean"),
    Mutation("fsdp_row_rate_from_steady_window", "hetpipe_jax/sim/compare.py",
             "  steps_per_s = lockstep_steps_per_s(report)\n",
             "  steps_per_s = report.total_minibatches_per_s / len(plan.gpus)\n",
             ("tests/test_fsdp.py::test_compare_row_rate_is_the_closed_form_with_different_gpus",),
             "compare's fsdp rate reads the steady-state window, low by about a step in n with different GPUs"),
    Mutation("fsdp_hetero_keeps_the_slower_cap", "hetpipe_jax/planning/fsdp_cost.py",
             "  return min(candidates, key=lambda p: p.step_s)", "  return max(candidates, key=lambda p: p.step_s)",
             ("tests/test_fsdp.py::test_hetero_keeps_the_faster_of_its_two_memory_caps",),
             "the heterogeneous variant keeps the slower of its two memory caps on the examples"),
    # issue: a VW's PS exchange off the scheduler thread (runtime/ps_channel.py)
    Mutation("pull_request_overtakes_push", "hetpipe_jax/runtime/ps_channel.py",
             '    self._ops.put(("pull", required_clock))',
             "    self._vw.ps.request_pull(required_clock)\n    self._pull_outstanding = True",
             ("tests/test_ps_channel.py::test_a_pull_request_never_overtakes_its_own_push",),
             "a pull request goes to the client at once, ahead of the VW's pushes still on the channel"),
    Mutation("wave_push_back_on_scheduler", "hetpipe_jax/runtime/minibatch_update.py",
             "    if vw.ps_channel is not None and vw.ps_channel.running:", "    if False:",
             ("tests/test_ps_channel.py::test_a_slow_ps_overlaps_compute_with_the_same_numerics",),
             "the wave's push runs on the scheduler thread although the VW has a PS channel (no overlap)"),
    Mutation("channel_error_dropped", "hetpipe_jax/runtime/ps_channel.py",
             "        self._error = e\n", "        pass\n",
             ("tests/test_ps_channel.py::test_an_error_on_the_channel_thread_stops_the_run",),
             "an error on the PS channel thread (NaN loss, refused update) stops the channel but not the run"),
    Mutation("run_end_ignores_channel_error", "hetpipe_jax/runtime/vw_driver.py",
             "      channel.flush()", "      channel.stop()",
             ("tests/test_ps_channel.py::test_an_error_on_the_channel_thread_stops_the_run",),
             "the run's end waits for the channel but does not raise an error of its last pushes"),
    Mutation("pull_placed_on_scheduler", "hetpipe_jax/runtime/minibatch_update.py",
             "    placed = vw.ps_channel.take_placed(flat) if vw.ps_channel is not None else None",
             "    placed = None",
             ("tests/test_ps_channel.py::test_a_slow_ps_overlaps_compute_with_the_same_numerics",),
             "the scheduler's install places the pulled weights on the devices again (the channel's placement unused)"),
    Mutation("pipedream_on_the_channel", "hetpipe_jax/runtime/virtual_worker.py",
             'host.ps_channel == "thread" and self.update.supports_ps_channel\n',
             'host.ps_channel == "thread"\n',
             ("tests/test_ps_channel.py::test_where_the_channel_runs",),
             "PipeDream's VW gets a PS channel (its per-stage wave ends stay inline, its pulls would not)"),
    Mutation("segment_keeps_stale_pull", "hetpipe_jax/runtime/virtual_worker.py",
             "      self.ps_channel.drop_pulls()\n", "      pass\n",
             ("tests/test_ps_channel.py::test_a_new_segment_installs_no_pull_of_the_last",),
             "a new WSP segment installs a pull reply of the segment before the checkpoint barrier"),
)


def _copy_repo(dest: pathlib.Path) -> None:
  for name in COPIED:
    src = REPO_ROOT / name
    if src.is_dir():
      shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    else:
      shutil.copy2(src, dest / name)
  (dest / ".venv").symlink_to(REPO_ROOT / ".venv")


def apply(mutation: Mutation, root: pathlib.Path) -> None:
  """Applies ``mutation`` under ``root``.

  Raises:
    ValueError: the text to replace does not occur exactly once (the code moved: update the mutation).
  """
  path = root / mutation.path
  text = path.read_text()
  count = text.count(mutation.old)
  if count != 1:
    raise ValueError(f"mutation {mutation.name}: the text to replace occurs {count} times in {mutation.path} "
                     "(expected once): update the mutation to the current code")
  path.write_text(text.replace(mutation.old, mutation.new))


def run_one(mutation: Mutation, timeout_s: int) -> dict:
  """Runs ``mutation``'s tests on a mutated copy (``mutation.old == mutation.new``: unmutated); returns its row."""
  t0 = time.perf_counter()
  row = {"name": mutation.name, "what": mutation.what, "file": mutation.path, "tests": list(mutation.tests)}
  with tempfile.TemporaryDirectory(prefix=f"mutation_{mutation.name}_") as tmp:
    root = pathlib.Path(tmp)
    _copy_repo(root)
    try:
      apply(mutation, root)
    except ValueError as e:
      return {**row, "status": "error", "detail": str(e), "seconds": time.perf_counter() - t0}
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = str(root)
    # One persistent compilation cache for every copy (tests/conftest.py's; keyed by the HLO, so a mutated function
    # compiles anew): most named tests compile the same small stage functions.
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(REPO_ROOT / ".jax_cache"))
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *mutation.tests]
    try:
      proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
      return {**row, "status": "caught", "killed_by": f"timeout after {timeout_s} s",
              "seconds": time.perf_counter() - t0}
  seconds = time.perf_counter() - t0
  if proc.returncode == 0:
    return {**row, "status": "survived", "seconds": seconds}
  if proc.returncode == 1:
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, flags=re.MULTILINE)
    return {**row, "status": "caught", "killed_by": failed[0] if failed else "?", "seconds": seconds}
  return {**row, "status": "error", "detail": f"pytest exit {proc.returncode}: {proc.stdout[-1500:]}{proc.stderr[-500:]}",
          "seconds": seconds}


def select(only: list[str]) -> list[Mutation]:
  """The mutations named in ``only`` (all when empty).

  Raises:
    app.UsageError: an unknown name.
  """
  if not only:
    return list(MUTATIONS)
  known = {m.name: m for m in MUTATIONS}
  unknown = sorted(set(only) - set(known))
  if unknown:
    raise app.UsageError(f"unknown mutations {unknown}; known: {sorted(known)}")
  return [known[n] for n in only]


def main(argv) -> None:
  del argv
  mutations = select(_ONLY.value)
  if _LIST.value:
    rows = []
    for m in mutations:
      count = (REPO_ROOT / m.path).read_text().count(m.old)
      rows.append({"name": m.name, "file": m.path, "applies": count == 1, "tests": list(m.tests), "what": m.what})
    print(json.dumps(rows, indent=2))
    return
  t0 = time.perf_counter()
  if _BASELINE.value:
    tests = tuple(sorted({t for m in mutations for t in m.tests}))
    base = run_one(Mutation("baseline", mutations[0].path, mutations[0].old, mutations[0].old, tests, "no mutation"),
                   10 * _TIMEOUT_S.value)
    if base["status"] != "survived":
      print(json.dumps({"baseline": base}, indent=2))
      sys.exit(f"error: the named tests fail without any mutation ({base.get('killed_by', base.get('detail'))}); "
               "fix them first")
  with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, _JOBS.value)) as pool:
    rows = list(pool.map(lambda m: run_one(m, _TIMEOUT_S.value), mutations))
  caught = sum(r["status"] == "caught" for r in rows)
  report = {"num_mutations": len(rows), "num_caught": caught,
            "survived": [r["name"] for r in rows if r["status"] == "survived"],
            "errors": [r["name"] for r in rows if r["status"] == "error"],
            "total_wall_s": time.perf_counter() - t0, "rows": rows}
  for r in rows:
    print(f"{r['status']:>8}  {r['name']:<34} {r.get('killed_by', r.get('detail', ''))[:90]}  ({r['seconds']:.0f} s)",
          file=sys.stderr)
  print(json.dumps(report, indent=2))
  if caught != len(rows):
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
