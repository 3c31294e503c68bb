"""Mutation check: small semantic bugs, applied one at a time to a copy of the repository, must each fail a test.

Every mutation is anchored on code, never on a file path or on prose: it names a scope by its qualified name, a few
consecutive code lines inside that scope, their replacement, and the tests that should catch it. The scope is found
by parsing every ``.py`` file under ``SEARCHED``, so moving a module to another package never breaks a mutation;
editing a docstring or a comment never does either. Anchor syntax (``Mutation.where``):

- ``"required_global_clock"``: a module-level function or class; ``"VirtualWorker.install_pull"``: a method;
  ``"run.submit_ready"``: a function nested in ``run`` (Python's ``__qualname__`` without ``<locals>``).
- ``"METHODS"``, ``"Class.FIELD"``: a module- or class-level assignment (its whole statement), for tables and
  constants.
- ``"<module hetpipe_jax/rules/methods.py>"``: a whole module, only where nothing above fits.

``old`` is one or a few lines of code (comment- and docstring-free), compared line by line with the scope's code
lines after stripping each line's indentation and trailing comment; blank lines, comment lines and docstrings
between code lines are skipped. Exactly one scope with that name must contain the lines, exactly once: otherwise
the mutation is an error that names what was found (update the mutation to the code). Lines found only in a
docstring, a comment or a string-only statement are refused. ``new`` replaces the matched lines (and any comment
lines between them), indented like them: its lines keep their indentation relative to ``old``'s first line.

Each mutation runs in its own temporary copy of the repository (the package, tests, configs; the venv is shared),
with ``pytest -x`` on the named tests. A mutation is *caught* when a test fails; *survived* when all pass; *error*
when the mutation no longer applies or pytest could not run (exit codes 2-5); *timeout* counts as caught (a hang is
noticed) but is reported. Prints one JSON document; exits 1 unless every mutation is caught. CI runs it as its own
step (``.ci/run``); the default test suite only checks that every mutation applies.

  .venv/bin/python scripts/mutation_check.py [--only=name,name] [--jobs=2] [--list] [--test_timeout_s=240]
"""

from __future__ import annotations

import ast
import concurrent.futures
import dataclasses
import io
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tokenize

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

COPIED = ("hetpipe_jax", "tests", "experiments", "scripts", "docs", "pytest.ini", "README.md")
SEARCHED = ("hetpipe_jax", "scripts", "experiments")  # where anchors' scopes are looked up


@dataclasses.dataclass(frozen=True)
class Mutation:
  """One small semantic bug.

  Attributes:
    name: short id.
    where: the scope holding the code: a qualified name (``"VirtualWorker.install_pull"``), see the module
      docstring.
    old: one or a few consecutive code lines of that scope (indentation and trailing comments not compared).
    new: their replacement (lines indented relative to ``old``'s first line; ``""`` deletes them).
    tests: pytest node ids or files that must catch it.
    what: the bug in words.
  """

  name: str
  where: str
  old: str
  new: str
  tests: tuple[str, ...]
  what: str


@dataclasses.dataclass(frozen=True)
class Scope:
  """A function, class, assignment or module that an anchor can name.

  Attributes:
    path: the file, relative to the root searched.
    qualname: its anchor name.
    first: its first line (1-based, decorators included).
    last: its last line (inclusive).
  """

  path: str
  qualname: str
  first: int
  last: int


class Source:
  """One parsed file: its lines, each line's code text and its scopes.

  Attributes:
    path: the file, relative to the root searched.
    lines: the physical lines (without their newline).
    code: per line (0-based) the code with indentation and trailing comment stripped, or None for a blank line, a
      comment line, or a line of a docstring or other string-only statement.
    scopes: every function, class, module- or class-level assignment, and the module itself.
  """

  def __init__(self, path: str, text: str):
    tree = ast.parse(text, filename=path)
    self.path = path
    self.lines = text.split("\n")
    code: list[str | None] = [line.strip() for line in self.lines]
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
      if tok.type == tokenize.COMMENT:
        row, col = tok.start
        code[row - 1] = self.lines[row - 1][:col].strip()
    for node in ast.walk(tree):
      if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
          and isinstance(node.value.value, str)):
        for i in range(node.lineno - 1, node.end_lineno):
          code[i] = None
    self.code = [c or None for c in code]
    self.scopes = [Scope(path, f"<module {path}>", 1, len(self.lines))]
    self._walk(tree, "", in_function=False)

  def _walk(self, node: ast.AST, prefix: str, in_function: bool) -> None:
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        first = min([child.lineno] + [d.lineno for d in child.decorator_list])
        self.scopes.append(Scope(self.path, prefix + child.name, first, child.end_lineno))
        self._walk(child, prefix + child.name + ".", in_function or not isinstance(child, ast.ClassDef))
        continue
      if isinstance(child, (ast.Assign, ast.AnnAssign)) and not in_function:
        targets = child.targets if isinstance(child, ast.Assign) else [child.target]
        for t in targets:
          for name in ([t] if isinstance(t, ast.Name) else getattr(t, "elts", [])):
            if isinstance(name, ast.Name):
              self.scopes.append(Scope(self.path, prefix + name.id, child.lineno, child.end_lineno))
      self._walk(child, prefix, in_function)

  def find(self, scope: Scope, lines: list[str], code_only: bool = True) -> list[tuple[int, int]]:
    """Where ``lines`` (stripped) occur as consecutive code lines of ``scope``: (first, last) line numbers, 1-based.

    With ``code_only=False`` every non-blank line counts, docstrings and comments included (to explain a refusal).
    """
    if code_only:
      seq = [(i + 1, self.code[i]) for i in range(scope.first - 1, scope.last) if self.code[i] is not None]
    else:
      seq = [(i + 1, self.lines[i].strip()) for i in range(scope.first - 1, scope.last) if self.lines[i].strip()]
    k = len(lines)
    return [(seq[i][0], seq[i + k - 1][0]) for i in range(len(seq) - k + 1)
            if all(seq[i + j][1] == lines[j] for j in range(k))]


class Index:
  """Every scope under ``root``'s searched folders, by qualified name (files parsed once)."""

  def __init__(self, root: pathlib.Path):
    self.root = pathlib.Path(root)
    self.sources: dict[str, Source] = {}
    self.by_name: dict[str, list[Scope]] = {}
    for folder in SEARCHED:
      for file in sorted((self.root / folder).rglob("*.py")):
        if "__pycache__" in file.parts:
          continue
        rel = file.relative_to(self.root).as_posix()
        source = Source(rel, file.read_text())
        self.sources[rel] = source
        for scope in source.scopes:
          self.by_name.setdefault(scope.qualname, []).append(scope)


def anchor_lines(mutation: Mutation) -> list[str]:
  """``mutation.old``'s lines, stripped.

  Raises:
    ValueError: ``old`` is empty or has a blank or comment line (an anchor is code).
  """
  lines = [line.strip() for line in mutation.old.strip("\n").split("\n")]
  bad = [line for line in lines if not line or line.startswith("#")]
  if bad:
    raise ValueError(f"mutation {mutation.name}: its old lines must all be code, not blank or comments: {bad}")
  return lines


def locate(mutation: Mutation, index: Index) -> tuple[Scope, int, int]:
  """The scope and the lines (first, last; 1-based) that ``mutation`` replaces.

  Raises:
    ValueError: no scope has that name; the lines occur in none of them, or only in docstrings, comments or
      string-only statements; or they occur more than once (in one scope or in several scopes of that name).
  """
  lines = anchor_lines(mutation)
  scopes = index.by_name.get(mutation.where, [])
  if not scopes:
    raise ValueError(f"mutation {mutation.name}: no function, class or assignment named {mutation.where!r} under "
                     f"{', '.join(SEARCHED)}: update the mutation to the code")
  found = [(s, a, b) for s in scopes for a, b in index.sources[s.path].find(s, lines)]
  named = ", ".join(f"{s.path}:{s.first}" for s in scopes)
  if len(found) == 1:
    return found[0]
  if found:
    places = ", ".join(f"{s.path}:{a}" for s, a, _ in found)
    raise ValueError(f"mutation {mutation.name}: its lines occur {len(found)} times in scopes named "
                     f"{mutation.where!r} ({places}): add a neighbouring code line to the anchor")
  prose = [(s, a) for s in scopes for a, _ in index.sources[s.path].find(s, lines, code_only=False)]
  if prose:
    places = ", ".join(f"{s.path}:{a}" for s, a in prose)
    raise ValueError(f"mutation {mutation.name}: its lines occur in {mutation.where!r} only in a docstring, a "
                     f"comment or a string-only statement ({places}): anchor on code lines, without comments")
  raise ValueError(f"mutation {mutation.name}: its lines occur in none of the {len(scopes)} scopes named "
                   f"{mutation.where!r} ({named}): update the mutation to the code")


def _indent(line: str) -> int:
  return len(line) - len(line.lstrip(" "))


def replacement(mutation: Mutation, indent: int) -> list[str]:
  """``mutation.new``'s lines, re-indented for a match whose first line is indented by ``indent`` spaces.

  Raises:
    ValueError: a line of ``new`` would be indented left of column 0.
  """
  base = _indent(mutation.old.strip("\n").split("\n")[0])
  if not mutation.new.strip("\n"):
    return []
  out = []
  for line in mutation.new.strip("\n").split("\n"):
    column = indent + _indent(line) - base
    if column < 0:
      raise ValueError(f"mutation {mutation.name}: its new line {line.strip()!r} lies left of column 0")
    out.append(" " * column + line.strip() if line.strip() else "")
  return out


def apply(mutation: Mutation, root: pathlib.Path, index: Index | None = None) -> Scope:
  """Applies ``mutation`` under ``root``; returns the scope it changed.

  Raises:
    ValueError: the anchor does not name exactly one place in the code (see ``locate``).
  """
  index = index or Index(root)
  scope, first, last = locate(mutation, index)
  lines = list(index.sources[scope.path].lines)
  lines[first - 1:last] = replacement(mutation, _indent(lines[first - 1]))
  (pathlib.Path(root) / scope.path).write_text("\n".join(lines))
  return scope


MUTATIONS = (
    # ---- the six bugs of the test audit
    Mutation("wsp_caps_D_at_1", "required_global_clock",
             "return max(0, local_clock - staleness_bound)",
             "return max(0, local_clock - min(staleness_bound, 1))",
             ("tests/test_virtual_time.py::test_virtual_time_reaches_staleness_bound_two_without_wave_end_pulls",),
             "the VW never runs more than 1 wave ahead whatever D is"),
    Mutation("loss_halved", "cross_entropy_loss",
             "return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()",
             "return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean() * 0.5",
             ("tests/test_references.py",),
             "the training loss is half the cross-entropy"),
    Mutation("loss_sum_not_mean", "cross_entropy_loss",
             "return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()",
             "return optax.softmax_cross_entropy_with_integer_labels(logits, labels).sum()",
             ("tests/test_references.py",),
             "the minibatch loss is summed, not averaged, over examples"),
    Mutation("install_pull_forgets_own_waves", "WSPRule.keep_own_waves",
             "keep = wsp.own_waves_after_pull(self.own_waves, vector_clock[self.vw.vw_id])",
             "keep = []",
             ("tests/test_pipeline.py::test_pull_while_own_waves_are_unapplied_keeps_them",),
             "pulled weights lose the VW's own pushed but unapplied waves"),
    Mutation("partitioner_no_second_pass", "partition_dp",
             "if np.isfinite(total):",
             "if False:",
             ("tests/test_partitioner.py",),
             "min-max optima are not tie-broken by least total time"),
    Mutation("auto_packing_demands_one_more_vw", "AutoSearch.search",
             "if not self.beats(slowest) or not self.packable(have, k):",
             "if not self.beats(slowest) or not self.packable(have, min(k + 1, self.num_vws)):",
             ("tests/test_allocator.py::test_auto_matches_exhaustive_search_over_every_allocation",),
             "auto's packing relaxation prunes too much (asks room for one VW more than remain)"),
    Mutation("auto_placement_bound_takes_the_worst", "AutoSearch.best_placement",
             "self.placement_bounds[key] = max((self.exact(take)[0] for take in self.layouts(full, n, -1)), default=0.0)",
             "self.placement_bounds[key] = min((self.exact(take)[0] for take in self.layouts(full, n, -1)), default=0.0)",
             ("tests/test_allocator.py::test_auto_searches_virtual_workers_of_exactly_max_vw_gpus",
              "tests/test_allocator.py::test_auto_placement_bound_keeps_the_search_result"),
             "auto's placement bound takes a type vector's worst placement, not its best, and prunes good splits"),
    Mutation("hd_pairing_skips_every_later_partner", "_pairings",
             "if node_class[rest[i]] in seen:",
             "if seen:",
             ("tests/test_allocator.py::test_hd_pairing_with_class_skipping_is_the_exhaustive_first_minimum",),
             "HD's pairing skips partners of classes not yet tried (only the first partner of each node is scored)"),
    Mutation("relaxed_bound_too_low", "throughput_upper_bound_per_s",
             "bound = MS_PER_S / best_ms if np.isfinite(best_ms) else 0.0",
             "bound = 0.98 * MS_PER_S / best_ms if np.isfinite(best_ms) else 0.0",
             ("tests/test_allocator.py::test_throughput_bounds_are_upper_bounds_of_every_small_virtual_worker",),
             "the relaxed-partition throughput bound is 2 % below its proof"),
    Mutation("round_trip_bound_one_cut_too_many", "round_trip_lower_bound_ms",
             "return float(compute + 2 * cuts[:len(gpu_types) - 1].sum())",
             "return float(compute + 2 * cuts[:len(gpu_types)].sum())",
             ("tests/test_allocator.py::test_throughput_bounds_are_upper_bounds_of_every_small_virtual_worker",),
             "the round-trip lower bound counts one cut more than a partition crosses (Little's-law bound too low)"),
    Mutation("little_bound_at_one_nm_less", "little_bound_per_s",
             "return max_num_inflight * MS_PER_S / trip * (1 + 1e-9) if trip > 0 else np.inf",
             "return (max_num_inflight - 0.5) * MS_PER_S / trip * (1 + 1e-9) if trip > 0 else np.inf",
             ("tests/test_allocator.py::test_throughput_bounds_are_upper_bounds_of_every_small_virtual_worker",),
             "the Little's-law bound uses half an Nm less than the range's top"),
    Mutation("auto_levels_skip_nm_1", "AutoSearch.__init__",
             "self.levels: list[tuple[int, int | None]] = [(m, m) for m in range(1, self.tail_nm)] + [(self.tail_nm,"
             " None)]",
             "self.levels: list[tuple[int, int | None]] = [(m, m) for m in range(2, self.tail_nm)] + [(self.tail_nm,"
             " None)]",
             ("tests/test_allocator.py::test_auto_matches_exhaustive_search_over_every_allocation",),
             "auto's Nm levels miss system Nm = 1 (splits whose best Nm is 1 are never searched there)"),
    Mutation("engine_no_ps_link_contention", "Engine._ps_transfer_arrival",
             "if contention:",
             "if False:",
             ("tests/test_engine.py",),
             "ps_link_contention=True is ignored"),
    # ---- network rule (shared NICs)
    Mutation("nic_no_queue", "NicState.leg_end",
             "start = max(t, self.send_free.get(src, 0.0), self.recv_free.get(dst, 0.0))",
             "start = t",
             ("tests/test_network.py",),
             "a NIC carries any number of transfers at once (no sharing)"),
    Mutation("nic_half_duplex", "NicState.leg_end",
             "self.send_free[src] = end\n"
             "self.recv_free[dst] = end",
             "self.send_free[src] = self.recv_free[src] = end\n"
             "self.recv_free[dst] = self.send_free[dst] = end",
             ("tests/test_network.py",),
             "a NIC's send and receive sides block each other"),
    Mutation("nic_intra_node_uses_the_nic", "Leg.inter_node",
             "return self.src is not None and self.dst is not None and self.src != self.dst",
             "return self.src is not None and self.dst is not None",
             ("tests/test_network.py",),
             "traffic between GPUs of one node queues at the node's NIC"),
    Mutation("engine_sends_ignore_the_nic", "_VW.__init__",
             "if config.shared_nic:",
             "if False:",
             ("tests/test_network.py",),
             "pipeline activations and gradients never wait for a shared NIC"),
    Mutation("engine_ps_ignores_the_nic", "Engine.run",
             "end = self.nic.leg_end(t, legs[i])",
             "end = t + legs[i].seconds",
             ("tests/test_network.py",),
             "PS pushes and pull replies never wait for a shared NIC"),
    Mutation("compare_ignores_shared_nic", "run_plan",
             "records=False, method=plan.method, shared_nic=config.shared_nic,",
             "records=False, method=plan.method,",
             ("tests/test_network.py",),
             "compare --noshared_nic still runs the shared-NIC rule"),
    Mutation("simulate_ignores_shared_nic", "main",
             "shared_nic=_SHARED_NIC.value,",
             "",
             ("tests/test_network.py",),
             "simulate --noshared_nic still runs the shared-NIC rule (and records it)"),
    Mutation("engine_ps_legs_booked_ahead", "Engine._send_ps_transfer",
             "if self.config.shared_nic and legs and not self.config.ps_link_contention:",
             "if False:",
             ("tests/test_network.py",),
             "a push books every leg's NIC time when sent, holding back transfers "
             "that could run before its later legs are ready"),
    Mutation("engine_pull_overtakes_a_push_on_the_nics", "Engine._request_pull",
             "if vw.leg_pushes_arrived < vw.leg_pushes_sent:",
             "if False:",
             ("tests/test_network.py",),
             "a pull request overtakes the VW's push still crossing the NICs"),
    Mutation("allreduce_ignores_the_nic", "ring_groups_time_s",
             "if not shared_nic:\n"
             "  per_nic = {}",
             "per_nic = {}",
             ("tests/test_network.py",),
             "rings crossing one NIC run at full speed together"),
    # ---- pipeline schedule
    Mutation("schedule_nm_plus_one_in_flight", "PipelineRules.can_inject",
             "return self.num_in_flight < self.num_inflight",
             "return self.num_in_flight <= self.num_inflight",
             ("tests/test_schedule.py", "tests/test_engine.py"),
             "Nm + 1 minibatches may be in flight"),
    Mutation("schedule_wave_end_off_by_one", "is_wave_end",
             "return (minibatch_id + 1) % num_inflight == 0",
             "return minibatch_id % num_inflight == 0",
             ("tests/test_wsp.py",),
             "a wave ends at its first minibatch, not its last"),
    # ---- WSP
    Mutation("wsp_required_clock_off_by_one", "required_global_clock",
             "return max(0, local_clock - staleness_bound)",
             "return max(0, local_clock - staleness_bound - 1)",
             ("tests/test_wsp.py",),
             "the staleness bound allows D + 1"),
    Mutation("wsp_pulls_served_before_clock", "ParameterServerState.serve_pending_pulls",
             "ready = [v for v, required in pending.items() if required <= clock]",
             "ready = [v for v, required in pending.items() if required <= clock + 1]",
             ("tests/test_wsp.py",),
             "a pending pull is answered one clock too early"),
    # ---- parameter server
    Mutation("ps_applies_update_negated", "ParameterServer.push",
             "self.weights += self._pending.pop(key)",
             "self.weights -= self._pending.pop(key)",
             ("tests/test_virtual_time.py",),
             "the PS subtracts wave updates instead of adding them"),
    Mutation("ps_on_receipt_update_negated", "ParameterServer.push",
             "self.weights += np.asarray(delta, np.float32)",
             "self.weights -= np.asarray(delta, np.float32)",
             ("tests/test_virtual_time.py",),
             "the on-receipt PS subtracts wave updates instead of adding them"),
    # ---- WSP as the paper defines it: updates applied on receipt, vector clocks (issue 14)
    Mutation("ps_on_receipt_waits_for_the_clock", "ParameterServerState.push",
             "if self.ps_apply == \"on_receipt\":",
             "if False:",
             ("tests/test_wsp.py",),
             "ps_apply='on_receipt' defers each wave until every VW pushed it"),
    Mutation("install_pull_readds_waves_the_ps_holds", "WSPRule.keep_own_waves",
             "keep = wsp.own_waves_after_pull(self.own_waves, vector_clock[self.vw.vw_id])",
             "keep = wsp.own_waves_after_pull(self.own_waves, min(vector_clock))",
             ("tests/test_pipeline.py::test_pull_while_own_waves_are_unapplied_keeps_them",),
             "a pull re-adds own waves beyond the global clock that the on-receipt PS already applied"),
    Mutation("records_claim_the_global_clock_only", "VirtualWorker.inject",
             "v.local_updates, v.global_clock, v.vector_clock, now)",
             "v.local_updates, v.global_clock, (v.global_clock,) * self.num_virtual_workers, now)",
             ("tests/test_virtual_time.py::test_virtual_time_run_equals_replay_of_its_versions",),
             "minibatch records hide the extra updates their weights hold"),
    Mutation("engine_forgets_the_pulled_vector_clock", "Engine.run",
             "vw.vector_clock = arg",
             "",
             ("tests/test_engine.py",),
             "engine records keep the initial vector clock after pulls"),
    # ---- checkpoints and resume (issue 9)
    Mutation("resume_skips_optimizer_state", "resume",
             "vw.load_opt_state(*point.opt_states[vw_id])",
             "pass",
             ("tests/test_resume.py::test_virtual_run_interrupted_and_resumed_is_bit_identical_to_the_uninterrupted_run",
              "tests/test_resume_mpi.py::test_kill_a_vw_after_a_checkpoint_then_resume_to_the_end"),
             "a resumed VW starts with a fresh optimizer state (virtual time and MPI: the VW role's one resume)"),
    Mutation("resume_restarts_the_data", "RunContext.minibatches_at",
             "return self.start_minibatch + (clock - self.clock0) * self.job.num_inflight",
             "return (clock - self.clock0) * self.job.num_inflight",
             ("tests/test_resume.py::test_virtual_run_interrupted_and_resumed_is_bit_identical_to_the_uninterrupted_run",
              "tests/test_resume_mpi.py::test_kill_a_vw_after_a_checkpoint_then_resume_to_the_end"),
             "a resumed VW reads its data from the start again (virtual time and MPI: one rule)"),
    Mutation("ps_accepts_nan_updates", "ParameterServer.push",
             "if not np.isfinite(delta).all():",
             "if False:",
             ("tests/test_resume.py::test_parameter_server_refuses_nan_and_wrong_size_before_touching_the_weights",),
             "the PS adds NaN/Inf updates to the global weights"),
    Mutation("opt_state_layers_misaligned", "join_layers",
             "parts = [layer[k] for layer in per_layer]",
             "parts = [layer[k] for layer in per_layer[::-1]]",
             ("tests/test_resume.py",),
             "optimizer states land on the wrong layers after a resume"),
    # ---- runtime
    Mutation("dispatch_uses_current_version", "UpdateRule.forward_params",
             "return mb.version.params[stage_id]",
             "return self.vw.version.params[stage_id]",
             ("tests/test_pipeline.py",),
             "a stage uses the VW's latest weights, not the minibatch's version"),
    # ---- partitioner and cost model
    Mutation("cost_model_no_optimizer_state", "StageCosts.memory_matrix_bytes",
             "return params * copies + opt + kept + (num_inflight - held) * inp + self.workspace_max",
             "return params * copies + kept + (num_inflight - held) * inp + self.workspace_max",
             ("tests/test_cost_model.py",),
             "stage memory leaves out the optimizer state"),
    Mutation("schedule_memory_accepts_unchecked", "self_consistent_partition",
             "if np.all(peaks <= h):",
             "if True:",
             ("tests/test_inflight_memory.py",),
             "the schedule mode accepts a partition without checking it fits at its own schedule peaks"),
    Mutation("dp_held_of_stage_zero_everywhere", "_dp",
             "cand = op(cap(mid[k - 1][c][None] + a[None, :, None] + rnext[:, None, :]), fnext[:, None, :])",
             "cand = op(cap(mid[0][c][None] + a[None, :, None] + rnext[:, None, :]), fnext[:, None, :])",
             ("tests/test_inflight_memory.py",),
             "the DP counts every stage position with stage 0's held count"),
    Mutation("schedule_bound_run_too_short", "num_minibatches_for_bound",
             "return 4 * num_stages * num_inflight + 4 * num_inflight",
             "return num_inflight",
             ("tests/test_inflight_memory.py",),
             "the schedule bound is taken from the start-up burst alone"),
    Mutation("one_f_one_b_extra_warmup", "forwards_before_first_backward",
             "k = num_stages - stage_id",
             "k = num_stages - stage_id + 1",
             ("tests/test_methods.py",),
             "1F1B-flush runs one warm-up forward too many"),
    Mutation("allreduce_no_flush", "injection_step",
             "if cap is not None and cap - first < room:",
             "if False:",
             ("tests/test_methods.py",),
             "the next step's micro-batches start before the all-reduced update"),
    Mutation("engine_allreduce_free", "Engine._enter_allreduce",
             "done = t + self.allreduce_s",
             "done = t",
             ("tests/test_methods.py",),
             "the engine's all-reduce takes no time"),
    Mutation("gpipe_memory_holds_one", "forwards_before_first_backward",
             "k = window",
             "k = 1",
             ("tests/test_methods.py",),
             "GPipe's order and memory hold one micro-batch"),
    Mutation("pipedream_stage_update_skipped", "PerStageUpdate.on_backward",
             "self.stage_update(stage_id, mb, grads)",
             "pass",
             ("tests/test_methods_runtime.py::test_pipedream_weight_stashing_equals_sequential_replay",),
             "PipeDream's stages never apply their own updates (weights stay at the pulled ones)"),
    Mutation("allreduce_mean_over_one_vw", "FlushUpdate.__init__",
             "self._divisors = jax.device_put([np.float32(vw.num_virtual_workers * vw.num_inflight)] * len(vw.stages),",
             "self._divisors = jax.device_put([np.float32(vw.num_inflight)] * len(vw.stages),",
             ("tests/test_methods_runtime.py::test_virtual_time_allreduce_methods_equal_union_training",),
             "the all-reduced gradient is summed over the VWs, not averaged"),
    Mutation("cost_model_no_receive_time", "StageCosts.stage_time_ms",
             "t += float(self.recv_ms[prev_link][i])",
             "t += 0.0",
             ("tests/test_cost_model.py", "tests/test_partitioner.py"),
             "a stage's time leaves out receiving its input activation"),
    # ---- engine
    Mutation("engine_backward_takes_forward_time", "Engine._start",
             "d, leg = gpu.dur_bwd, gpu.leg_bwd",
             "d, leg = gpu.dur_fwd, gpu.leg_bwd",
             ("tests/test_engine.py",),
             "backward tasks last as long as forward tasks"),
    # ---- data
    Mutation("sharding_overlapping_shards", "shard_indices",
             "return permutation[shard_id * shard_size:(shard_id + 1) * shard_size].astype(np.int64)",
             "return permutation[:shard_size].astype(np.int64)",
             ("tests/test_data.py",),
             "every VW gets the same shard"),
    Mutation("text_held_out_block_also_trained", "split_runs",
             "held.append(block)",
             "held.append(block)\n"
             "run.append(block)",
             ("tests/test_text_lm.py::test_text_split_is_fixed_and_held_out_bytes_never_trained_on",),
             "the held-out blocks are also in the training text"),
    Mutation("user_dataset_shape_unchecked", "validate_dataset",
             "if x.ndim < 1 or tuple(x.shape[1:]) != tuple(example_shape):",
             "if x.ndim < 1:",
             ("tests/test_user_model_data.py::test_bad_model_or_dataset_is_one_config_error_naming_the_setting",),
             "a dataset whose examples do not fit the model is accepted (and fails later, inside training)"),
    Mutation("user_model_factory_result_unchecked", "load_model",
             "if not isinstance(spec, ModelSpec):",
             "if False:",
             ("tests/test_user_model_data.py::test_bad_model_or_dataset_is_one_config_error_naming_the_setting",),
             "a user factory returning something other than a ModelSpec is accepted"),
    # ---- models
    Mutation("gpt_attention_not_causal", "CausalSelfAttention.__call__",
             "causal = jnp.tril(jnp.ones((s, s), bool))[None, None]",
             "causal = jnp.ones((s, s), bool)[None, None]",
             ("tests/test_text_lm.py::test_causal_masking_later_tokens_do_not_change_earlier_logits",),
             "self-attention sees later tokens (the LM can read the byte it must predict)"),
    # ---- evaluation
    Mutation("bits_per_byte_in_nats", "_bits_per_byte",
             "return {\"test_bits_per_byte\": test_loss / math.log(2.0)}",
             "return {\"test_bits_per_byte\": test_loss}",
             ("tests/test_text_lm.py::test_next_token_evaluation_matches_a_numpy_reference_in_bits_per_byte",),
             "the LM's held-out loss is reported in nats under the name bits per byte"),
    Mutation("evaluation_counts_padding", "Evaluator.evaluate",
             "n += m",
             "n += b",
             ("tests/test_references.py",),
             "the padded examples of the last evaluation batch are counted"),
    # ---- job: schedule, run length, staleness bound reached under MPI
    Mutation("cosine_schedule_too_long", "learning_rate",
             "lr = optax.cosine_decay_schedule(optim.learning_rate, num_minibatches)",
             "lr = optax.cosine_decay_schedule(optim.learning_rate, 2 * num_minibatches)",
             ("tests/test_job_promises.py::test_learning_rate_schedule_follows_its_closed_form",),
             "the cosine schedule decays over twice the run, not over each VW's minibatches"),
    Mutation("run_length_not_whole_waves", "minibatches_per_vw",
             "total -= total % unit",
             "",
             ("tests/test_job_promises.py::test_minibatches_per_vw_rounds_down_to_whole_waves",),
             "a VW trains a partial last wave"),
    Mutation("wsp_forces_D_zero_in_the_vw", "VWSyncState.injection_gate",
             "if may_inject(self.local_clock, self.weights_global_clock, self.staleness_bound):",
             "if may_inject(self.local_clock, self.weights_global_clock, 0):",
             ("tests/test_mpi_job.py::test_wsp_bound_holds_and_is_reached_with_three_vws",),
             "the VW's injection gate behaves as D = 0 whatever D is (BSP)"),
    # ---- job settings
    Mutation("settings_drop_nm_override", "_settings_from_plan",
             "num_inflight = plan.num_inflight if given is None else given",
             "num_inflight = plan.num_inflight",
             ("tests/test_job_config.py",),
             "a user's num_inflight is silently replaced by the plan's"),
    # ---- runtime host path (issue 10)
    Mutation("executor_times_from_pickup", "StageExecutor._loop",
             "start = submitted if submitted > device_free else device_free",
             "start = picked",
             ("tests/test_stage_executor.py",),
             "an emulated task starts when the executor thread picks it up, not on the emulated device's timeline"),
    Mutation("runtime_hands_off_after_updates", "run",
             "if taken:\n"
             "  with lock:\n"
             "    submit_ready()\n"
             "if finished:\n"
             "  t = time.perf_counter()\n"
             "  for c in finished:\n"
             "    p = c.task.minibatch_id\n"
             "    with lock:\n"
             "      mb = inflight.pop(p)\n"
             "    vw.complete_minibatch(mb, c.end_s)\n"
             "    num_finished += 1\n"
             "    wave, pull = vw.sync.on_minibatch_complete(p)\n"
             "    if wave is not None:\n"
             "      t_wave = time.perf_counter()\n"
             "      if vw.end_wave(wave):\n"
             "        vw.sync.on_reduced(wave)\n"
             "      stats.push_s += time.perf_counter() - t_wave\n"
             "    if pull is not None:\n"
             "      ps.request_pull(pull)\n"
             "  stats.update_s += time.perf_counter() - t",
             "if finished:\n"
             "  t = time.perf_counter()\n"
             "  for c in finished:\n"
             "    p = c.task.minibatch_id\n"
             "    with lock:\n"
             "      mb = inflight.pop(p)\n"
             "    vw.complete_minibatch(mb, c.end_s)\n"
             "    num_finished += 1\n"
             "    wave, pull = vw.sync.on_minibatch_complete(p)\n"
             "    if wave is not None:\n"
             "      t_wave = time.perf_counter()\n"
             "      if vw.end_wave(wave):\n"
             "        vw.sync.on_reduced(wave)\n"
             "      stats.push_s += time.perf_counter() - t_wave\n"
             "    if pull is not None:\n"
             "      ps.request_pull(pull)\n"
             "  stats.update_s += time.perf_counter() - t\n"
             "if taken:\n"
             "  with lock:\n"
             "    submit_ready()",
             ("tests/test_runtime_host_path.py::test_tasks_made_ready_start_before_the_minibatch_updates",),
             "tasks made ready by a completion the scheduler thread books wait until the completed minibatches' "
             "updates are applied"),
    Mutation("flush_accumulator_keeps_last_microbatch", "FlushUpdate.on_backward",
             "self.grad_acc[s] = st.add(self.grad_acc[s], grads)",
             "self.grad_acc[s] = grads",
             ("tests/test_methods_runtime.py::test_flush_methods_in_one_vw_equal_single_device_training",),
             "a flush method's step keeps only each stage's last micro-batch gradients, not their sum"),
    Mutation("stage_completions_booked_out_of_order", "run.post",
             "if not routed[s] and not schedule.completes_minibatch(c.task):",
             "if not schedule.completes_minibatch(c.task):",
             ("tests/test_runtime_host_path.py::test_tasks_made_ready_start_before_the_minibatch_updates",
              "tests/test_pipeline.py::test_oracle2_replay_of_recorded_versions"),
             "a stage's completion is booked on its executor while the stage's earlier one waits for the scheduler "
             "thread (booked out of the stage's order)"),
    Mutation("every_hop_through_the_scheduler", "run.post",
             "if c.error is None:",
             "if False:",
             ("tests/test_runtime_host_path.py::test_a_hop_between_stages_does_not_wait_for_the_scheduler_thread",),
             "every completion goes through the scheduler thread (two wake-ups per cross-stage hop)"),
    Mutation("sharded_pull_ignores_shard_clocks", "rebase_on_shards",
             "for c in wsp.own_waves_after_pull(keep, applied):",
             "for c in wsp.own_waves_after_pull(keep, min(own_applied)):",
             ("tests/test_ps_shards.py::test_pull_from_shards_at_different_clocks_equals_per_shard_replay",),
             "after a pull from shards at different clocks, own waves are re-added by the minimum clock on every "
             "shard (twice on shards that already hold them)"),
    Mutation("local_placement_is_round_robin", "assign_layers",
             "elif policy == \"default\":",
             "elif policy in (\"default\", \"local\"):",
             ("tests/test_ps_shards.py::test_runtime_placement_is_the_planners",),
             "the local parameter placement puts layers round-robin instead of on the node that runs them"),
    Mutation("shard_slice_lost_at_the_end", "gather_shards",
             "shards.scatter(flat, shard, part)",
             "",
             ("tests/test_ps_shards.py::test_rank0_assembles_the_final_weights_from_every_shard",),
             "rank 0 saves W0 for the layers of the other shards instead of their final slices"),
    Mutation("pull_bytes_not_counted", "ParameterServerService._serve_pulls",
             "ps_client.PS_BYTES.add(dest, part.nbytes)",
             "",
             ("tests/test_ps_shards.py::test_served_pulls_are_counted_per_destination_rank",),
             "the transport does not count pulled weights in the PS bytes per rank pair"),
    Mutation("timing_plan_nm_unchecked", "timing_plan_task_times",
             "(\"num_inflight\", plan.num_inflight, job.num_inflight),",
             "(\"num_inflight\", plan.num_inflight, plan.num_inflight),",
             ("tests/test_timing_plan.py::test_a_timing_plan_that_does_not_describe_the_run_is_refused",),
             "a timing plan made for another Nm times the run (its schedule of versions is not the plan's)"),
    Mutation("timing_plan_drops_ps_times", "timing_plan_task_times",
             "return plan_times_lib.task_times_from_plan(plan, plan_times_lib.profile_for_plan(plan),\n"
             "                                           cluster_lib.load_cluster(plan.cluster))",
             "return [dataclasses.replace(t, push_s=0.0, pull_s=0.0) for t in plan_times_lib.task_times_from_plan(\n"
             "    plan, plan_times_lib.profile_for_plan(plan), cluster_lib.load_cluster(plan.cluster))]",
             ("tests/test_timing_plan.py::test_timing_plan_gives_the_plans_own_task_times",),
             "the timing plan's task times lose the PS push and pull (a different schedule of versions)"),
    Mutation("allreduce_step_stamped_at_its_start", "AllReduceHooks.on_allreduce",
             "self._pending[step] = [len(self.vws), float(summed[-1]) / (len(self.vws) * self.vws[0].num_inflight)]",
             "self._pending[step] = [len(self.vws), float(summed[-1]) / (len(self.vws) * self.vws[0].num_inflight)]\n"
             "if self.on_step is not None:\n"
             "  self.on_step(step, t, self._pending[step][1])\n"
             "  self._pending[step][0] = -1",
             ("tests/test_paper_convergence.py::test_horovod_time_is_steps_times_slowest_replica_plus_allreduce",),
             "virtual time reports an all-reduce step (metrics, evaluation) when its reduction starts, before any "
             "replica holds the update"),
    # ---- stage ranks (issue 12)
    Mutation("stage_version_wait_skipped", "VersionStore.get",
             "if version_id not in self._versions:",
             "if version_id not in self._versions:\n"
             "  return self._versions[self.latest]",
             ("tests/test_stage_ranks.py::test_a_task_waits_until_its_version_has_been_applied",),
             "a stage rank runs a task whose weight version has not arrived on the latest version it holds"),
    Mutation("control_stream_sent_without_its_lock", "RemoteStages._control",
             "with self._send_lock:",
             "if True:",
             ("tests/test_stage_ranks.py::test_control_messages_from_two_threads_arrive_whole",),
             "two threads' control messages interleave: a header lands in another message's payload buffer"),
    Mutation("clock_pair_keeps_first_reading", "clock_pair",
             "if best is None or b - a < best[0]:",
             "if best is None:",
             ("tests/test_stage_executor.py::test_clock_pair_keeps_the_tightest_bracketed_reading",),
             "the run clock's pair is read once, however long the thread was away between its reads"),
    Mutation("stage_header_check_disabled", "check_header",
             "if wrong:",
             "if False:",
             ("tests/test_wire.py::test_a_header_that_does_not_match_raises_the_one_protocol_error",
              "tests/test_stage_ranks.py::test_a_header_that_does_not_match_is_an_error_naming_both_ranks",
              "tests/test_stage_ranks.py::test_a_link_refuses_an_activation_whose_header_does_not_match"),
             "a header with the wrong kind, VW, minibatch, stage, version or size is accepted"),
    Mutation("stage_pull_slice_without_own_waves", "StageRankServer._install_pull",
             "local, self.own_flat = rebase_on_shards(flat, self.own_flat, [int(c) for c in own_applied],"
             " self.shard_index)",
             "local = flat",
             ("tests/test_stage_ranks.py::test_stage_ranks_equal_the_replay_of_recorded_versions_with_lagging_pulls",),
             "after a pull, stage ranks' stages lack the VW's own pushed waves the PS has not applied yet"),
    Mutation("stage_wave_counted_before_all_parts", "WaveAssembler.add",
             "if len(got) < len(senders):",
             "if vw_parts.driver not in got:",
             ("tests/test_ps_shards.py::test_stage_ranks_parts_and_a_wave_counted_once_all_parts_arrived",
              "tests/test_stage_ranks.py::test_stage_ranks_equal_the_replay_of_recorded_versions_with_lagging_pulls",
              "tests/test_stage_ranks.py::test_stage_ranks_train_exactly_as_one_process"),
             "a shard counts (and applies) a VW's wave once its driver's part arrived, before the stage ranks' parts"),
    Mutation("stage_rank_pushes_to_the_wrong_shard", "push_parts",
             "isend(Kind.PUSH, wave_id, np.ascontiguousarray(values[index], np.float32), dest=shard)",
             "isend(Kind.PUSH, wave_id, np.ascontiguousarray(values[index], np.float32),\n"
             "      dest=(shard + 1) % parts.num_shards if rank != parts.driver else shard)",
             ("tests/test_launch.py::test_stage_ranks_move_ps_bytes_between_their_own_nodes_and_shards",),
             "a stage rank pushes its part of a wave to another shard than the one holding those layers"),
    Mutation("stage_wave_delta_not_reset", "PerMinibatchUpdate.take_wave_delta",
             "for s in vw.local_stages:\n"
             "  self.wave_delta[s] = vw.zeros[s]",
             "",
             ("tests/test_stage_ranks.py::test_stage_ranks_train_exactly_as_one_process",),
             "a stage rank's wave delta keeps the earlier waves' updates (each pushed again with every later wave)"),
    Mutation("stage_update_skipped_on_stage_ranks", "PerMinibatchUpdate.on_complete",
             "vw.placement.on_update(mb.record.minibatch_id, vw.version.version_id, norm)",
             "if mb.record.minibatch_id % 2:\n"
             "  vw.placement.on_update(mb.record.minibatch_id, vw.version.version_id, norm)",
             ("tests/test_stage_ranks.py::test_stage_ranks_train_exactly_as_one_process",),
             "the driver does not send every minibatch's update to its stage ranks (their versions fall behind)"),
    # ---- paper reproduction (issue 13)
    Mutation("type_efficiency_ignored", "_roofline_ms",
             "if gpu.roofline_efficiency is not None:",
             "if False:",
             ("tests/test_cost_model.py::test_per_type_roofline_efficiency_replaces_the_config_efficiencies",
              "tests/test_paper_experiments.py::test_calibration_recovers_known_efficiencies_from_horovod_rates"),
             "a GPU type's calibrated roofline efficiency is ignored (the config's 0.5 is used)"),
    Mutation("fixed_num_inflight_ignored", "plan_system",
             "if num_inflight > 0:",
             "if False:",
             ("tests/test_paper_experiments.py::test_planner_fixes_hetpipe_num_inflight_or_says_why_not",),
             "the planner ignores a fixed hetpipe Nm and chooses its own"),
    Mutation("engine_nm_choice_keeps_the_first", "choose_num_inflight_by_engine",
             "if best is None or row.images_per_s > best[1].images_per_s * 1.001:",
             "if best is None:",
             ("tests/test_paper_experiments.py::test_num_inflight_chosen_by_the_engine_is_the_fastest_engine_run",),
             "choose_num_inflight_by_engine keeps Nm = 1 instead of the fastest engine run"),
    Mutation("compare_ignores_nm_by_engine", "compare.attempt",
             "if config.num_inflight_by_engine and pc.recipe.num_inflight_by_engine and allocation in PIPELINE_POLICIES:",
             "if False and pc.recipe.num_inflight_by_engine and allocation in PIPELINE_POLICIES:",
             ("tests/test_paper_experiments.py::test_compare_with_nm_by_engine_is_never_slower_than_the_planners_nm",),
             "compare --num_inflight_by_engine silently keeps the planner's closed-form Nm"),
    Mutation("jitter_also_on_sends", "Engine._start",
             "d += (gpu.comp_bwd if task.kind is _BACKWARD else gpu.comp_fwd) * (draw(mu, sigma) - 1.0)",
             "d *= draw(mu, sigma)",
             ("tests/test_engine_jitter.py",),
             "the task-time jitter also stretches the output's send"),
    Mutation("jitter_mean_not_one", "Engine.__init__",
             "self._jitter = (random.Random(config.jitter_seed).lognormvariate, -0.5 * sigma * sigma, sigma)",
             "self._jitter = (random.Random(config.jitter_seed).lognormvariate, 0.0, sigma)",
             ("tests/test_engine_jitter.py",),
             "the log-normal jitter factor's mean is exp(sigma^2 / 2), not 1"),
    Mutation("jitter_cv_is_sigma", "Engine.__init__",
             "sigma = math.sqrt(math.log1p(config.task_time_cv ** 2))",
             "sigma = config.task_time_cv * 0.5",
             ("tests/test_engine_jitter.py",),
             "the jitter's coefficient of variation is not the one set"),
    Mutation("memory_cap_not_enforced", "PipelineRules._startable",
             "if queue[0].kind is not _FORWARD or self._held[stage_id] < self.max_held[stage_id]:",
             "if True:",
             ("tests/test_memory_caps.py",),
             "a forward starts on a stage already holding its memory cap"),
    Mutation("memory_cap_blocks_backwards", "PipelineRules._startable",
             "if task.kind is _BACKWARD:",
             "if False:",
             ("tests/test_memory_caps.py::test_a_held_back_forward_lets_the_ready_backward_pass",
              "tests/test_memory_caps.py::test_random_instances_complete_within_their_caps"),
             "a held-back forward blocks the backward behind it (FIFO kept strictly: the pipeline deadlocks)"),
    Mutation("virtual_job_drops_memory_caps", "update_settings",
             "max_held=job.memory_caps[vw_id] if job.memory_caps else None, **options)",
             "max_held=None, **options)",
             ("tests/test_memory_caps.py::test_virtual_job_from_a_schedule_plan_records_and_enforces_its_caps",),
             "virtual time records a schedule plan's caps but does not enforce them"),
    Mutation("memory_caps_at_any_nm", "memory_caps",
             "or num_inflight != plan.num_inflight or any(vw.held_per_stage is None for vw in plan.virtual_workers)):",
             "or any(vw.held_per_stage is None for vw in plan.virtual_workers)):",
             ("tests/test_memory_caps.py::test_memory_caps_come_from_schedule_plans_at_their_nm",),
             "caps counted at the plan's Nm are applied to a run at another Nm"),
    # issue 23 defects 1, 3, 4, 5, 6 (README launch and device index, method settings, world-size fix, slots, shards)
    Mutation("gpu_index_no_node_default", "ClusterSpec.device_index",
             "return self.local_devices.get(gpu_id, node_local_index(gpu_id))",
             "return self.local_devices.get(gpu_id)",
             ("tests/test_launch.py::test_a_gpus_device_index_defaults_to_its_index_on_its_node",),
             "a GPU the cluster file does not map gets no device index (the README's launch stops)"),
    Mutation("cluster_local_devices_ignored", "ClusterSpec.device_index",
             "return self.local_devices.get(gpu_id, node_local_index(gpu_id))",
             "return node_local_index(gpu_id)",
             ("tests/test_launch.py::test_a_gpus_device_index_defaults_to_its_index_on_its_node",),
             "the cluster file's local_devices no longer overrides a GPU's index on its node"),
    Mutation("hostfile_slots_ignored", "check_slots",
             "if have is not None and len(on_host) > have:",
             "if False:",
             ("tests/test_launch.py::test_hostfile_slots_limit_the_ranks_on_each_host_unless_oversubscribed",),
             "a host gets more ranks than its hostfile slots without --oversubscribe"),
    Mutation("allreduce_accepts_ps_shards", "METHOD_SETTINGS",
             "MethodSetting(\"num_ps_shards\", None, _PS_METHODS, \"sets the parameter-server shards\"),",
             "MethodSetting(\"num_ps_shards\", None, methods.METHODS, \"sets the parameter-server shards\"),",
             ("tests/test_job_config.py::test_every_method_refuses_the_settings_it_does_not_use",),
             "gpipe, 1f1b_flush and horovod accept num_ps_shards, run without a PS and record it"),
    Mutation("world_size_suggests_negative_vws", "check_world_size",
             "if settings.plan is None and not settings.num_stage_ranks and fits >= 1 and not per_vw else \"\")",
             "if settings.plan is None and not settings.num_stage_ranks and not per_vw else \"\")",
             ("tests/test_job_config.py::test_the_world_size_error_suggests_only_fixes_that_work",),
             "the world-size error suggests a VW count below 1"),
    Mutation("empty_ps_shard_runs", "ps_layer_shards",
             "if empty and settings.ps_placement != \"local\":",
             "if False:",
             ("tests/test_ps_shards.py::test_a_shard_without_parameters_is_refused_under_default_placement",),
             "a PS shard left without parameters (more shards than parameterised layers) runs silently"),
    Mutation("hostfile_slots_not_summed", "hostfile_slots",
             "slots[host] = slots.get(host, 0) + (int(count) if colon else 1)",
             "slots[host] = int(count) if colon else 1",
             ("tests/test_launch.py::test_hostfile_slots_limit_the_ranks_on_each_host_unless_oversubscribed",
              "tests/test_launch.py::test_a_gpus_device_index_defaults_to_its_index_on_its_node"),
             "a host on several hostfile lines gets only its last line's slots (four localhost:5 lines: 5, not 20)"),
    Mutation("readme_launch_without_gpu_index", "ClusterSpec.device_index",
             "return self.local_devices.get(gpu_id, node_local_index(gpu_id))",
             "return self.local_devices.get(gpu_id)",
             ("tests/test_readme.py::test_readme_commands_run_as_written",),
             "the README's plan-then-launch example stops (the README test runs it as written)"),
    # ---- issue 23, behaviour no test checked (direct tests of each gap)
    Mutation("sharded_rebase_prunes_by_the_newest_shard", "rebase_on_shards",
             "return local, {c: own_flat[c] for c in keep}",
             "return local, {c: own_flat[c] for c in keep if c >= max(own_applied)}",
             ("tests/test_ps_shards.py::test_own_waves_survive_a_shard_lagging_behind_two_pulls_in_a_row",),
             "after a sharded pull the VW keeps only the own waves the most advanced shard lacks: a wave a lagging "
             "shard still lacks at the next pull is lost there"),
    Mutation("ps_pull_answered_with_live_weights", "ParameterServer.snapshot",
             "return self.state.vector_clock(), self.weights.copy()",
             "return self.state.vector_clock(), self.weights",
             ("tests/test_wsp.py::test_a_snapshot_is_a_copy_that_later_pushes_leave_unchanged",
              "tests/test_methods_runtime.py::test_pipedream_with_two_vws_and_pulls_equals_an_event_order_replay"),
             "a pull is answered with the live global weights, so pushes applied before the VW installs it leak in"),
    Mutation("ps_reply_sends_the_live_weights", "ParameterServerService._serve_pulls",
             "vector_clock, weights = self.server.pull_reply(vw)",
             "vector_clock, weights = self.server.state.vector_clock(), self.server.weights",
             ("tests/test_ps_shards.py::test_a_pull_reply_carries_the_weights_as_answered_while_later_pushes_land",),
             "the PS service sends the live global weights as a pull's reply; pushes applied before the send "
             "completes change what the VW receives"),
    Mutation("sharded_pull_clock_is_the_max_over_shards", "MPIPSClient.poll_pull",
             "vector_clock = tuple(min(vc[v] for vc in per_shard) for v in range(self.num_virtual_workers))",
             "vector_clock = tuple(max(vc[v] for vc in per_shard) for v in range(self.num_virtual_workers))",
             ("tests/test_ps_shards.py::test_a_sharded_pull_holds_the_element_wise_minimum_of_its_shards_vector_clocks",),
             "a sharded pull's vector clock is the most advanced shard's, not what every layer holds"),
    Mutation("sharded_pull_clock_is_the_lead_shards", "MPIPSClient.poll_pull",
             "vector_clock = tuple(min(vc[v] for vc in per_shard) for v in range(self.num_virtual_workers))",
             "vector_clock = per_shard[0]",
             ("tests/test_ps_shards.py::test_a_sharded_pull_holds_the_element_wise_minimum_of_its_shards_vector_clocks",),
             "a sharded pull's vector clock is the lead shard's (rank 0), not the minimum over shards"),
    Mutation("partition_mid_stage_memory_strict", "_cost_tables",
             "by_count[h] = ([np.where(mem_mid <= cap, comp, np.inf) for comp, cap in zip(comps, caps)],",
             "by_count[h] = ([np.where(mem_mid < cap, comp, np.inf) for comp, cap in zip(comps, caps)],",
             ("tests/test_partitioner.py::test_a_stage_needing_exactly_the_usable_memory_fits",),
             "a non-last stage needing exactly its GPU's usable memory is taken not to fit"),
    Mutation("partition_last_stage_memory_strict", "_cost_tables",
             "last = [np.where(mem_last <= cap, comp, np.inf) for comp, cap in zip(comps, caps)]",
             "last = [np.where(mem_last < cap, comp, np.inf) for comp, cap in zip(comps, caps)]",
             ("tests/test_partitioner.py::test_a_stage_needing_exactly_the_usable_memory_fits",),
             "the last stage needing exactly its GPU's usable memory is taken not to fit"),
    Mutation("partition_fits_strict", "Partition.fits",
             "return all(m <= c for m, c in zip(self.stage_memory_bytes, self.capacity_bytes))",
             "return all(m < c for m, c in zip(self.stage_memory_bytes, self.capacity_bytes))",
             ("tests/test_partitioner.py::test_a_stage_needing_exactly_the_usable_memory_fits",),
             "a partition whose stage needs exactly the usable memory is reported as not fitting"),
    Mutation("auto_vw_sizes_below_max_vw_gpus", "AutoSearch.__init__",
             "if min_size <= sum(n) <= self.max_size]",
             "if min_size <= sum(n) < self.max_size]",
             ("tests/test_allocator.py::test_auto_searches_virtual_workers_of_exactly_max_vw_gpus",),
             "auto never builds a VW of exactly max_vw_gpus GPUs"),
    Mutation("auto_next_vw_below_max_vw_gpus", "AutoSearch.type_vectors",
             "hi = min(self.max_size, total - (k - 1))",
             "hi = min(self.max_size - 1, total - (k - 1))",
             ("tests/test_allocator.py::test_auto_searches_virtual_workers_of_exactly_max_vw_gpus",),
             "auto's split search gives the next VW at most max_vw_gpus - 1 GPUs"),
    Mutation("engine_pull_request_before_the_push", "Engine._complete_minibatch",
             "  return",
             "  return\n"
             "if pull is not None:\n"
             "  self._request_pull(vw, pull, t)\n"
             "  pull = None",
             ("tests/test_engine.py::test_a_vw_pull_request_never_overtakes_its_own_push",),
             "at a wave end the engine sends the VW's pull request before its push, so the reply lacks the wave"),
    Mutation("engine_pull_request_ignores_the_push_in_flight", "Engine._request_pull",
             "self._push_event(max(t, vw.last_push_arrival), _PULL_REQUEST, vw.vw_id, required)",
             "self._push_event(t, _PULL_REQUEST, vw.vw_id, required)",
             ("tests/test_engine.py::test_a_vw_pull_request_never_overtakes_its_own_push",),
             "a pull request reaches the PS before the VW's push sent just before it (no ordered channel)"),
    Mutation("flush_loss_averaged_over_one_vw", "FlushUpdate.apply_reduced",
             "self.on_step(step, float(summed[-1]) / count)",
             "self.on_step(step, float(summed[-1]) / vw.num_inflight)",
             ("tests/test_methods_runtime.py::test_flush_methods_with_two_vws_report_the_mean_loss_over_every_micro_batch",),
             "the flush methods report a step's loss summed over the VWs (averaged over one VW's micro-batches)"),
    Mutation("pipedream_pull_forgets_own_waves", "PerStageUpdate.on_pull",
             "for c in keep:\n"
             "  p = st.add(p, self.own_waves[c][s])",
             "",
             ("tests/test_methods_runtime.py::test_pipedream_with_two_vws_and_pulls_equals_an_event_order_replay",),
             "PipeDream's pull drops the VW's own pushed waves the pulled weights do not hold yet"),
    Mutation("pipedream_pull_drops_unpushed_deltas", "PerStageUpdate.on_pull",
             "for _, d in sorted(self.stage_wave_delta[s].items()):\n"
             "  p = st.add(p, d)",
             "pass",
             ("tests/test_methods_runtime.py::test_pipedream_with_two_vws_and_pulls_equals_an_event_order_replay",),
             "PipeDream's pull drops each stage's updates of waves not pushed yet"),
    Mutation("pipedream_pull_leaves_stashed_versions", "PerStageUpdate.on_pull",
             "if self.vertical_sync:",
             "if False:",
             ("tests/test_methods_runtime.py::test_pipedream_with_two_vws_and_pulls_equals_an_event_order_replay",),
             "with vertical sync, a pull rebases each stage's latest weights but not its kept older versions"),
    Mutation("pipedream_pull_rebases_stage_zero_only", "PerStageUpdate.on_pull",
             "for s, st in enumerate(vw.stages):",
             "for s, st in enumerate(vw.stages[:1]):",
             ("tests/test_methods_runtime.py::test_pipedream_with_two_vws_and_pulls_equals_an_event_order_replay",),
             "PipeDream's pull installs the pulled weights on stage 0 only"),
    # ---- issue 23: global-norm clipping, diverged replicas fail, replayable runs (wt_b)
    Mutation("grad_clip_by_each_stage_norm", "_jit_stage.clipped",
             "return grad_clip.clip(grads, norm, max_norm) if max_norm > 0 else grads",
             "return grad_clip.clip(grads, jnp.sqrt(grad_clip.stage_sq_norm(grads)), max_norm) if max_norm > 0 else"
             " grads",
             ("tests/test_global_clip.py::test_pipelines_clip_by_the_global_norm_whatever_the_partition",
              "tests/test_global_clip.py::test_flush_methods_clip_the_mean_gradient_by_its_global_norm"),
             "grad_clip_norm clips each stage's gradient by its own norm (the numerics depend on the partition)"),
    Mutation("stage_rank_sq_norm_not_reported", "StageRankServer._report",
             "sq_norm = float(jax.device_get(self.vw.stages[s].sq_norm(self.inflight[c.task.minibatch_id].grads[s])))",
             "sq_norm = 0.0 *"
             " float(jax.device_get(self.vw.stages[s].sq_norm(self.inflight[c.task.minibatch_id].grads[s])))",
             ("tests/test_stage_ranks.py::test_stage_ranks_clip_by_the_global_norm_over_every_rank",),
             "a stage rank reports no squared norm: the driver clips by the norm of its own stages only"),
    Mutation("diverged_replicas_pass", "check_replicas_identical",
             "if len(groups) > 1:",
             "if False:",
             ("tests/test_global_clip.py::test_virtual_time_replicas_that_diverge_fail_the_run",
              "tests/test_global_clip.py::test_mpi_replicas_that_diverge_exit_non_zero_with_an_error"),
             "an all-reduce run whose replicas ended with different weights finishes with exit 0"),
    Mutation("recorded_example_ids_of_another_minibatch", "ShardedMinibatches.get_with_ids",
             "return self._images[idx], self._labels[idx], idx",
             "return self._images[idx], self._labels[idx], self.indices(minibatch_id + 1)",
             ("tests/test_replayable_runs.py::test_a_virtual_time_run_replays_from_its_outputs_alone",),
             "minibatches.jsonl's example_ids are not the examples the minibatch trained on"),
    Mutation("initial_weights_hash_of_other_weights", "replay_fields",
             "return {\"replay\": {\"initial_weights_sha256\": weights_sha256(flat0), \"initial_weights_num_params\":"
             " int(flat0.size),",
             "return {\"replay\": {\"initial_weights_sha256\": weights_sha256(flat0[::-1]),"
             " \"initial_weights_num_params\": int(flat0.size),",
             ("tests/test_replayable_runs.py::test_a_virtual_time_run_replays_from_its_outputs_alone",),
             "config.json's initial weights' hash is not the hash of the weights the run started from"),
    # issue 28: the memory model against the paper's Horovod facts
    Mutation("workspace_counts_no_freed_stash", "workspace_beyond_stash",
             "out[i, i + 1:] = np.maximum.accumulate(reach[i:]) - stash_prefix[i + 1:]",
             "out[i, i + 1:] = np.maximum.accumulate(ws[i:])",
             ("tests/test_memory_facts.py::test_workspace_beyond_stash_matches_a_liveness_replay",
              "tests/test_memory_facts.py::test_horovod_whole_model_fits_where_the_paper_ran_it",
              "tests/test_cost_model.py::test_stage_memory_formula"),
             "a layer's temporaries are added on top of the whole stash (none reuses the freed residuals)"),
    Mutation("workspace_without_activation_gradients", "build_stage_costs",
             "[l.workspace_bytes + b + l.output_activation_bytes for l, b in zip(layers, bbytes)], stash),",
             "[l.workspace_bytes for l, b in zip(layers, bbytes)], stash),",
             ("tests/test_cost_model.py::test_stage_memory_formula",),
             "the backward's activation gradients (received and produced by a layer) are not counted"),
    Mutation("xla_stage_peak_without_resident_state", "stage_memory",
             "peak = max(pm.total_bytes + (0 if name == \"update\" else resident) for name, pm in programs.items())",
             "peak = max(pm.total_bytes for name, pm in programs.items())",
             ("tests/test_xla_memory.py::test_stage_memory_reads_the_stage_programs",),
             "XLA's stage peak leaves out the optimizer state and accumulator outside the forward/backward's arguments"),
    Mutation("profiler_records_no_xla_temp", "profile_model",
             "workspace_bytes=max(_temp_bytes(fwd_c), _temp_bytes(bwd_c)))",
             "workspace_bytes=0)",
             ("tests/test_xla_memory.py::test_cost_model_within_20_percent_of_xla_on_two_stages",),
             "the profiler records no XLA temporaries: the cost model falls below XLA's own accounting"),
    Mutation("relu_keeps_a_float_mask", "_relu_fwd",
             "return jnp.maximum(x, 0), x > 0",
             "return jnp.maximum(x, 0), (x > 0).astype(x.dtype)",
             ("tests/test_memory_facts.py::test_relu_keeps_only_a_mask_and_matches_flax_relu",),
             "the ReLU keeps a full-size float32 mask for its backward instead of a 1-byte one"),
    Mutation("bottleneck_tail_not_rematerialised", "Bottleneck.__call__",
             "return nn.remat(NormAddReLU)(project)(y, x)",
             "return NormAddReLU(project)(y, x)",
             ("tests/test_memory_facts.py::test_bottleneck_keeps_what_fused_batch_norm_keeps",),
             "the bottleneck's last GroupNorm + add + ReLU keeps autodiff's residuals, not only its inputs"),
    Mutation("conv_relu_keeps_flax_zeros", "ConvReLU.__call__",
             "return relu(nn.Conv(self.features, self.kernel_size, self.strides, padding=\"SAME\")(x))",
             "return nn.relu(nn.Conv(self.features, self.kernel_size, self.strides, padding=\"SAME\")(x))",
             ("tests/test_memory_facts.py::test_saved_paper_profiles_hold_what_the_models_keep",),
             "VGG-19's conv layers use flax's relu again (its backward keeps a float32 zeros array): the saved "
             "profiles no longer hold what the model keeps"),
    # issue 25 item 1: optimizers made for delay (nadam, nadamw, b1 up to 0.99, muon per stage).
    Mutation("muon_takes_the_head", "muon_dimension_numbers",
             "lambda path, leaf, i=i: MuonDimensionNumbers(0, 1) if i != output_layer and _is_muon_leaf(path, leaf)"
             " else None,",
             "lambda path, leaf, i=i: MuonDimensionNumbers(0, 1) if _is_muon_leaf(path, leaf) else None,",
             ("tests/test_optimizers.py::test_muon_rule_picks_the_hand_listed_hidden_matrices",),
             "Muon orthogonalizes the output layer's kernel (the head) too"),
    Mutation("muon_takes_conv_kernels", "_is_muon_leaf",
             "return getattr(last, \"key\", None) == \"kernel\" and len(leaf.shape) == 2",
             "return getattr(last, \"key\", None) == \"kernel\" and len(leaf.shape) >= 2",
             ("tests/test_optimizers.py::test_muon_rule_picks_the_hand_listed_hidden_matrices",),
             "Muon takes 4-D convolution kernels as well as Dense matrices"),
    Mutation("muon_stage_takes_first_layers_rule", "make_optimizer",
             "adam_weight_decay=decay, muon_weight_dimension_numbers=dims[start:end],",
             "adam_weight_decay=decay, muon_weight_dimension_numbers=dims[:end - start],",
             ("tests/test_optimizers.py::test_each_stage_gives_muon_the_same_leaves_whichever_stage_holds_them",),
             "a stage applies the rule of the model's first layers to its own (a layer's rule depends on its stage)"),
    Mutation("stage_builds_another_stages_optimizer", "build_stages",
             "_jit_stage(st, spec.layers[start:end], optimizers.for_layers(optimizer, start, end), loss_fn, remat)",
             "_jit_stage(st, spec.layers[start:end], optimizers.for_layers(optimizer, 0, end - start), loss_fn, remat)",
             ("tests/test_optimizers.py::test_pipelined_vw_equals_whole_model_optax",),
             "each stage's jitted update uses the transformation of the model's first layers"),
    Mutation("nadam_is_adam", "make_optimizer",
             "tx = optax.nadam(lr, b1=b1, b2=b2)",
             "tx = optax.adam(lr, b1=b1, b2=b2)",
             ("tests/test_optimizers.py::test_pipelined_vw_equals_whole_model_optax",),
             "config.optimizer='nadam' runs Adam without Nesterov momentum"),
    Mutation("nadamw_drops_weight_decay", "make_optimizer",
             "tx = optax.nadamw(lr, b1=b1, b2=b2, weight_decay=decay)",
             "tx = optax.nadamw(lr, b1=b1, b2=b2, weight_decay=0.0)",
             ("tests/test_optimizers.py::test_pipelined_vw_equals_whole_model_optax",),
             "nadamw runs without the recorded config.weight_decay"),
    Mutation("muon_adam_part_ignores_b1", "make_optimizer",
             "lr, beta=optim.muon_beta, weight_decay=decay, adam_b1=b1, adam_b2=b2,",
             "lr, beta=optim.muon_beta, weight_decay=decay, adam_b2=b2,",
             ("tests/test_optimizers.py::test_pipelined_vw_equals_whole_model_optax",),
             "Muon's Adam part (embeddings, head, norms, biases) runs optax's b1 = 0.9, not config.adam_b1"),
    Mutation("muon_beta_ignored", "make_optimizer",
             "lr, beta=optim.muon_beta, weight_decay=decay, adam_b1=b1, adam_b2=b2,",
             "lr, beta=0.95, weight_decay=decay, adam_b1=b1, adam_b2=b2,",
             ("tests/test_optimizers.py::test_pipelined_vw_equals_whole_model_optax",),
             "config.muon_beta is recorded but Muon runs its default momentum"),
    Mutation("opt_state_masked_parts_as_scalars", "_params_shaped",
             "jax.tree.structure(part, is_leaf=_is_masked) == want for part, want in zip(node, layers))",
             "jax.tree.structure(part) == want for part, want in zip(node, layers))",
             ("tests/test_optimizers.py::test_muon_state_moves_to_another_partition_through_a_checkpoint",),
             "Muon's per-layer state (with optax MaskedNode parts) is split as shared scalars, so it cannot move "
             "to another partition"),
    Mutation("opt_state_joined_by_structure", "join_layers",
             "if _leaf_shapes(want) != _leaf_shapes(got):",
             "if jax.tree.structure(want) != jax.tree.structure(got):",
             ("tests/test_optimizers.py::test_muon_state_moves_to_another_partition_through_a_checkpoint",),
             "a checkpoint's Muon state (orbax restores a MaskedNode part as None) no longer loads"),
    Mutation("adam_b1_of_one_accepted", "_check_optimizer_settings",
             "if not 0 <= value < 1:",
             "if not 0 <= value <= 1:",
             ("tests/test_optimizers.py::test_bad_optimizer_settings_are_one_error_each",),
             "adam_b1 = 1 (a mean that never moves) is accepted"),
    Mutation("negative_weight_decay_accepted", "_check_optimizer_settings",
             "if not decay >= 0:",
             "if False:",
             ("tests/test_optimizers.py::test_bad_optimizer_settings_are_one_error_each",),
             "nadamw runs with a negative weight decay (weights grow)"),
    Mutation("weight_decay_ignored_by_adam", "_check_optimizer_settings",
             "if value != default and config.optimizer not in users:",
             "if value != default and config.optimizer not in users + (\"adam\",):",
             ("tests/test_optimizers.py::test_bad_optimizer_settings_are_one_error_each",),
             "config.weight_decay with adam is recorded but not used (adam has none)"),
    Mutation("muon_refused_after_outputs", "prepare",
             "if settings.optim.optimizer == \"muon\":\n"
             "  _muon_layer_shapes(spec)",
             "",
             ("tests/test_optimizers.py::test_muon_for_a_model_without_hidden_matrices_stops_before_any_output",),
             "muon for a model without hidden matrices fails only when the optimizer is built, after config.json "
             "(and, under MPI, after the barrier: PS shard ranks would wait forever)"),
    Mutation("summary_omits_muon_params", "settings_summary",
             "optimizer[\"muon_params\"] = optimizers.muon_leaf_names(shapes)",
             "pass",
             ("tests/test_optimizers.py::test_every_method_in_virtual_time_equals_whole_model_optax",),
             "summary.json does not say which leaves Muon orthogonalized"),
    Mutation("summary_drops_optimizer_settings", "optimizer_summary",
             "if optim.optimizer in users}",
             "if False}",
             ("tests/test_optimizers.py::test_every_method_in_virtual_time_equals_whole_model_optax",),
             "summary.json's optimizer lacks the settings it ran with (b1, b2, weight decay, Muon's beta)"),
    # ---- issue 28: a device holding several stages; the wave path's one buffer per stage each way
    Mutation("stage_devices_must_be_distinct_again", "_parse_devices",
             "if min(devices) < 0:",
             "if min(devices) < 0 or len(set(devices)) != len(devices):",
             ("tests/test_job_config.py::test_a_device_may_hold_several_stages",),
             "two stages may not share a device: one GPU cannot run a VW (the GPU check's main job)"),
    Mutation("unravel_reads_every_leaf_from_the_start", "unravel_like",
             "pos += leaf.size",
             "pos += 0",
             ("tests/test_pipeline.py::test_pull_installed_mid_wave_keeps_own_and_partial_waves",),
             "a pulled stage's buffer is cut up wrongly on the device: every leaf starts at the buffer's first float"),
    Mutation("wave_flat_in_reverse_stage_order", "VirtualWorker.flat_of",
             "return np.concatenate(parts) if parts else np.zeros(0, np.float32)",
             "return np.concatenate(parts[::-1]) if parts else np.zeros(0, np.float32)",
             ("tests/test_pipeline.py::test_pull_installed_mid_wave_keeps_own_and_partial_waves",),
             "a wave's update is pushed with the stages' parts in reverse order (a layout the PS does not hold)"),
    # ---- issue 26: fsdp (ZeRO-3 / FSDP) in the cost model, the engine and compare (wt_f)
    Mutation("fsdp_allreduce_not_allgather", "_plan",
             "ag = np.array([0.5 * allreduce_cost.ring_groups_time_s([(pad * p, gpus)], cluster, True) for p in"
             " params])",
             "ag = np.array([1.0 * allreduce_cost.ring_groups_time_s([(pad * p, gpus)], cluster, True) for p in"
             " params])",
             ("tests/test_fsdp.py::test_zero3_communication_time_and_step_closed_form",),
             "an all-gather costs a whole ring all-reduce instead of half of one"),
    Mutation("fsdp_no_overlap_in_backward", "_plan.overlapped",
             "return float(np.sum(np.maximum(f_l, a)) + np.sum(np.maximum(b_l, 2 * a)))",
             "return float(np.sum(np.maximum(f_l, a)) + np.sum(b_l + 2 * a))",
             ("tests/test_fsdp.py::test_zero3_communication_time_and_step_closed_form",),
             "the backward's gathers and reduce-scatters are not overlapped with its compute"),
    Mutation("fsdp_bytes_two_collectives", "_plan",
             "bytes_sent_per_gpu=3.0 * (n - 1) / n * pad * total if n > 1 else 0.0,",
             "bytes_sent_per_gpu=2.0 * (n - 1) / n * pad * total if n > 1 else 0.0,",
             ("tests/test_fsdp.py::test_zero3_communication_time_and_step_closed_form",),
             "the communication volume leaves out the backward's all-gather"),
    Mutation("fsdp_unpadded_shards", "_plan",
             "pad = n * max(shards)",
             "pad = 1.0",
             ("tests/test_fsdp.py::test_uneven_shards_pad_the_collectives",),
             "uneven shards are gathered as if even (no padding to the largest shard)"),
    Mutation("fsdp_full_state_per_gpu", "_plan",
             "memory = [f * state + gathered + b * act for f, b in zip(shards, examples)]",
             "memory = [state + gathered + b * act for f, b in zip(shards, examples)]",
             ("tests/test_fsdp.py::test_memory_per_gpu_by_hand",),
             "every GPU holds the whole state (nothing is sharded)"),
    Mutation("fsdp_one_gathered_layer", "gathered_bytes",
             "return 3.0 * max((l.param_bytes for l in profile.layers), default=0)",
             "return 1.0 * max((l.param_bytes for l in profile.layers), default=0)",
             ("tests/test_fsdp.py::test_memory_per_gpu_by_hand",),
             "memory counts one gathered layer, not the prefetched one and the unsharded gradient"),
    Mutation("fsdp_remat_no_recompute", "_plan",
             "bwd = bwd + fwd",
             "bwd = bwd + 0 * fwd",
             ("tests/test_fsdp.py::test_memory_per_gpu_by_hand",),
             "activation checkpointing saves memory but costs no recomputation"),
    Mutation("fsdp_split_ignores_memory_caps", "split_examples",
             "if b[g] < caps[g]:",
             "if True:",
             ("tests/test_fsdp.py::test_split_examples_against_brute_force",
              "tests/test_fsdp.py::test_hetero_examples_by_speed_within_memory"),
             "the speed split gives a GPU more examples than its memory holds"),
    Mutation("fsdp_split_by_count_not_time", "split_examples",
             "heapq.heappush(heap, ((b[g] + 1) * per_example_s[g], g))",
             "heapq.heappush(heap, ((b[g] + 1), g))",
             ("tests/test_fsdp.py::test_split_examples_against_brute_force",
              "tests/test_fsdp.py::test_hetero_examples_by_speed_within_memory"),
             "examples are split evenly, whatever the GPUs' speeds"),
    Mutation("fsdp_shards_proportional_to_room", "memory_shards",
             "f = np.minimum(hi, room)",
             "f = room.copy()",
             ("tests/test_fsdp.py::test_hetero_shards_by_memory_against_a_grid",),
             "shards proportional to free memory: larger shards (padded collectives) than needed"),
    Mutation("fsdp_engine_no_exposed_comm", "fsdp_task_times",
             "push_s=0.0, pull_s=0.0, allreduce_s=free, stage_nodes=(g.node,),\n"
             "allreduce_shared_nic_s=exposed) for g, c in zip(plan.gpus, plan.compute_s)]",
             "push_s=0.0, pull_s=0.0, allreduce_s=0.0, stage_nodes=(g.node,),\n"
             "allreduce_shared_nic_s=0.0) for g, c in zip(plan.gpus, plan.compute_s)]",
             ("tests/test_fsdp.py::test_engine_step_equals_the_closed_form_on_a_homogeneous_cluster",),
             "the engine runs fsdp's compute without its collectives"),
    Mutation("fsdp_rows_left_out_of_compare", "compare",
             "for variant in fsdp_cost.VARIANTS:",
             "for variant in ():",
             ("tests/test_fsdp.py::test_compare_lists_both_fsdp_variants",),
             "compare lists no fsdp row"),
    Mutation("fsdp_runs_in_the_harness", "HARNESS_METHODS",
             "HARNESS_METHODS = tuple(m for m in METHODS if not _TABLE[m].sharded)",
             "HARNESS_METHODS = METHODS",
             ("tests/test_job_config.py::test_bad_settings_name_the_setting",),
             "config.method=fsdp is accepted by hetpipe_jax.train, which has no fsdp runtime"),
    Mutation("fsdp_runtime_replicates_state", "leaf_sharding",
             "if size >= n and size % n == 0:",
             "if False:",
             ("tests/test_fsdp.py::test_fsdp_validate_quick_end_to_end",),
             "the one-host runtime replicates parameters and optimizer state instead of sharding them"),
    Mutation("fsdp_runtime_half_batch", "FsdpTrainer.__init__.step",
             "value, grads = jax.value_and_grad(loss)(params, x, y)",
             "value, grads = jax.value_and_grad(loss)(params, x[: x.shape[0] // 2], y[: y.shape[0] // 2])",
             ("tests/test_fsdp.py::test_fsdp_validate_quick_end_to_end",),
             "the sharded step's gradient is one device's share of the batch, not the global mean"),
    Mutation("fsdp_row_rate_from_steady_window", "fsdp_row",
             "steps_per_s = lockstep_steps_per_s(report)",
             "steps_per_s = report.total_minibatches_per_s / len(plan.gpus)",
             ("tests/test_fsdp.py::test_compare_row_rate_is_the_closed_form_with_different_gpus",),
             "compare's fsdp rate reads the steady-state window, low by about a step in n with different GPUs"),
    Mutation("fsdp_hetero_keeps_the_slower_cap", "plan_fsdp",
             "return min(candidates, key=lambda p: p.step_s)",
             "return max(candidates, key=lambda p: p.step_s)",
             ("tests/test_fsdp.py::test_hetero_keeps_the_faster_of_its_two_memory_caps",),
             "the heterogeneous variant keeps the slower of its two memory caps on the examples"),
    # issue: a VW's PS exchange off the scheduler thread (runtime/ps_channel.py)
    Mutation("pull_request_overtakes_push", "PSChannel.request_pull",
             "self._ops.put((\"pull\", required_clock))",
             "self._vw.ps.request_pull(required_clock)\n"
             "self._pull_outstanding = True",
             ("tests/test_ps_channel.py::test_a_pull_request_never_overtakes_its_own_push",),
             "a pull request goes to the client at once, ahead of the VW's pushes still on the channel"),
    Mutation("wave_push_back_on_scheduler", "PerMinibatchUpdate.on_wave_end",
             "if vw.ps_channel is not None and vw.ps_channel.running:",
             "if False:",
             ("tests/test_ps_channel.py::test_a_slow_ps_overlaps_compute_with_the_same_numerics",),
             "the wave's push runs on the scheduler thread although the VW has a PS channel (no overlap)"),
    Mutation("channel_error_dropped", "PSChannel._loop",
             "self._error = e",
             "pass",
             ("tests/test_ps_channel.py::test_an_error_on_the_channel_thread_stops_the_run",),
             "an error on the PS channel thread (NaN loss, refused update) stops the channel but not the run"),
    Mutation("run_end_ignores_channel_error", "run",
             "channel.flush()",
             "channel.stop()",
             ("tests/test_ps_channel.py::test_an_error_on_the_channel_thread_stops_the_run",),
             "the run's end waits for the channel but does not raise an error of its last pushes"),
    Mutation("pull_placed_on_scheduler", "PerMinibatchUpdate.on_pull",
             "placed = vw.ps_channel.take_placed(flat) if vw.ps_channel is not None else None",
             "placed = None",
             ("tests/test_ps_channel.py::test_a_slow_ps_overlaps_compute_with_the_same_numerics",),
             "the scheduler's install places the pulled weights on the devices again (the channel's placement unused)"),
    Mutation("pipedream_on_the_channel", "VirtualWorker.__init__",
             "self.ps_channel = (PSChannel(self) if host.ps_channel == \"thread\" and self.update.supports_ps_channel",
             "self.ps_channel = (PSChannel(self) if host.ps_channel == \"thread\"",
             ("tests/test_ps_channel.py::test_where_the_channel_runs",),
             "PipeDream's VW gets a PS channel (its per-stage wave ends stay inline, its pulls would not)"),
    Mutation("segment_keeps_stale_pull", "VirtualWorker.begin_segment",
             "self.ps_channel.drop_pulls()",
             "pass",
             ("tests/test_ps_channel.py::test_a_new_segment_installs_no_pull_of_the_last",),
             "a new WSP segment installs a pull reply of the segment before the checkpoint barrier"),
    # ---- staleness-aware wave updates at the PS (ps_staleness_scaling)
    Mutation("ps_staleness_tau_off_by_one", "ParameterServerState._record_staleness",
             "tau = sum(vc[u] - pulled[u] for u in range(self.num_virtual_workers) if u != vw)",
             "tau = sum(vc[u] - pulled[u] for u in range(self.num_virtual_workers) if u != vw) + 1",
             ("tests/test_ps_staleness_scaling.py::test_tau_and_scale_of_a_hand_built_sequence",),
             "a wave update's staleness counts one wave too many"),
    Mutation("ps_staleness_counts_own_waves", "ParameterServerState._record_staleness",
             "tau = sum(vc[u] - pulled[u] for u in range(self.num_virtual_workers) if u != vw)",
             "tau = sum(vc[u] - pulled[u] for u in range(self.num_virtual_workers))",
             ("tests/test_ps_staleness_scaling.py::test_one_vw_has_tau_zero_always",),
             "a VW's own applied waves count as staleness of its next wave update"),
    Mutation("ps_staleness_scale_not_applied", "ParameterServer.push",
             "self.weights += np.float32(state.staleness[-1][1]) * np.asarray(delta, np.float32)",
             "self.weights += np.asarray(delta, np.float32)",
             ("tests/test_ps_staleness_scaling.py::test_tau_and_scale_of_a_hand_built_sequence",
              "tests/test_ps_staleness_scaling.py::test_virtual_time_inverse_equals_the_replay_with_the_recorded_scales"),
             "the PS records a wave update's staleness scale but adds the update unscaled"),
    Mutation("ps_staleness_clock_aligned_scale_not_applied", "ParameterServer.push",
             "self.weights += np.float32(scale) * self._pending.pop(key)",
             "self.weights += self._pending.pop(key)",
             ("tests/test_ps_staleness_scaling.py::test_clock_aligned_applies_the_scales",),
             "the clock-aligned PS adds held wave updates unscaled"),
    Mutation("ps_staleness_pull_not_noted", "ParameterServer.pull_reply",
             "self.state.note_pull(vw_id, vector_clock)",
             "pass",
             ("tests/test_ps_staleness_scaling.py::test_tau_and_scale_of_a_hand_built_sequence",),
             "a pull reply is not noted, so staleness is always counted from W0"),
    Mutation("ps_staleness_with_sharded_ps", "with_ps_shards",
             "if num > 1 and scaling != \"none\":",
             "if False:",
             ("tests/test_ps_staleness_scaling.py::test_bad_settings_are_one_error_each",),
             "a sharded PS, whose shards may see different staleness for one wave, accepts a staleness scaling"),
    Mutation("dc_sign", "compensate",
             "return jax.tree.map(lambda g, w, wp: g + (lam * g * g * (w - wp)).astype(g.dtype), grads, w_now, w_used)",
             "return jax.tree.map(lambda g, w, wp: g - (lam * g * g * (w - wp)).astype(g.dtype), grads, w_now, w_used)",
             ("tests/test_delay_compensation.py::test_formula_against_a_hand_computed_case",
              "tests/test_delay_compensation.py::test_hetpipe_with_dc_equals_the_sequential_replay"),
             "DC-ASGD's correction with the wrong sign (g - λ·g⊙g⊙(W_now − W_p))"),
    Mutation("dc_against_current_version", "PerMinibatchUpdate.on_complete",
             "mb.grads[s] = self.compensator(s, mb.grads[s], vw.version.params[s], mb.version.params[s])",
             "mb.grads[s] = self.compensator(s, mb.grads[s], vw.version.params[s], vw.version.params[s])",
             ("tests/test_delay_compensation.py::test_hetpipe_with_dc_equals_the_sequential_replay",),
             "HetPipe's DC takes W_p as the current weights (no correction at all)"),
    Mutation("dc_after_clip", "PerMinibatchUpdate.on_complete",
             ("if self.compensator is not None:\n"
              "for s in vw.local_stages:\n"
              "mb.grads[s] = self.compensator(s, mb.grads[s], vw.version.params[s], mb.version.params[s])\n"
              "norm = vw.minibatch_grad_norm(mb) if vw.grad_clip_norm else None"),
             ("norm = vw.minibatch_grad_norm(mb) if vw.grad_clip_norm else None\n"
              "if self.compensator is not None:\n"
              "  for s in vw.local_stages:\n"
              "    mb.grads[s] = self.compensator(s, mb.grads[s], vw.version.params[s], mb.version.params[s])"),
             ("tests/test_delay_compensation.py::test_dc_then_clip_equals_the_replay",),
             "HetPipe's global norm is taken over the uncorrected gradient (clip before DC)"),
    Mutation("pipedream_dc_against_latest", "PerStageUpdate.stage_update",
             "grads = self.compensator(s, grads, self.stage_params[s], self._used.pop((mb.record.minibatch_id, s)))",
             ("self._used.pop((mb.record.minibatch_id, s))\n"
              "grads = self.compensator(s, grads, self.stage_params[s], self.stage_params[s])"),
             ("tests/test_delay_compensation.py::test_pipedream_with_dc_equals_its_replay",),
             "PipeDream's DC takes W_p as the stage's latest weights, not the ones its forward stashed"),
    Mutation("dc_rule_option_dropped", "update_settings",
             "delay_compensation=optim.delay_compensation,",
             "",
             ("tests/test_delay_compensation.py::test_virtual_time_run_records_the_setting",),
             "the job records delay_compensation='dc' but its VWs run without it"),
    Mutation("dc_none_corrects", "make",
             "if settings.delay_compensation == \"none\":",
             "if False:",
             ("tests/test_delay_compensation.py::test_none_is_bit_identical_to_a_run_without_the_setting",),
             "delay_compensation='none' still corrects the gradients (with dc_lambda)"),
    Mutation("watchdog_blames_waiting_vws", "silent_vws",
             "if vw not in waiting and now_s - t >= (startup if vw in unheard else limit_s)]",
             "if now_s - t >= (startup if vw in unheard else limit_s)]",
             ("tests/test_recovery.py::test_watchdog_names_the_silent_vws_longest_first_and_spares_those_the_ps_owes",),
             "the PS's watchdog blames a VW that waits for a pull the PS holds back under the staleness bound"),
    Mutation("watchdog_no_startup_limit", "silent_vws",
             "if vw not in waiting and now_s - t >= (startup if vw in unheard else limit_s)]",
             "if vw not in waiting and now_s - t >= limit_s]",
             ("tests/test_recovery.py::test_watchdog_gives_a_vw_not_yet_heard_the_start_up_limit",),
             "a VW still compiling or restoring a checkpoint is called hung after the normal limit"),
    Mutation("recovery_names_last_exit", "diagnose",
             "first = exits[0]",
             "first = exits[-1]",
             ("tests/test_recovery.py::test_the_rank_that_ended_first_is_named_not_mpichs_lowest_rank",),
             "recovery blames the last rank to end (one the clean-up killed), not the one that failed first"),
    Mutation("recovery_never_fails_again", "gone_nodes",
             "if previous is not None and previous.nodes == failure.nodes:",
             "if False:",
             ("tests/test_recovery.py::test_a_node_is_gone_when_it_does_not_answer_or_its_rank_fails_again",),
             "a rank that fails again on the same nodes is restarted there forever"),
    Mutation("recovery_restarts_without_resume", "Supervisor.run",
             "resume = restart.resume_from is not None",
             "resume = False",
             ("tests/test_recovery.py::test_supervisor_restarts_a_killed_rank_from_its_checkpoint_then_stops_when_"
              "restarts_are_spent",),
             "a restart ignores the checkpoint and redoes the whole run"),
    # ---- weight prediction at injection and PipeMare's delay-scaled steps (rules/weight_prediction)
    Mutation("wp_bias_correction_at_current_count", "direction",
             "c1 = count + 1.0",
             "c1 = count",
             ("tests/test_weight_prediction.py::test_adam_prediction_against_a_hand_computed_case",),
             "Adam's predicted direction bias-corrected at the state's count, not the next step's"),
    Mutation("wp_nadam_as_adam", "direction",
             "m_hat = mu / (1.0 - b1 ** c1) if opt.name == \"adam\" else _nesterov_hat(mu, count, b1)",
             "m_hat = mu / (1.0 - b1 ** c1) if opt.name in (\"adam\", \"nadam\", \"nadamw\") else "
             "_nesterov_hat(mu, count, b1)",
             ("tests/test_weight_prediction.py::test_nadam_and_nadamw_prediction_against_hand_computed_cases",),
             "NAdam predicts with Adam's direction instead of its look-ahead form"),
    Mutation("wp_hetpipe_lookahead_counts_p", "hetpipe_lookahead",
             "return injected_before - completed",
             "return injected_before - completed + 1",
             ("tests/test_weight_prediction.py::test_hetpipe_lookahead_against_the_hand_traced_schedule",),
             "HetPipe's s counts p's own update among those that land before it"),
    Mutation("wp_hetpipe_runs_unpredicted", "PerMinibatchUpdate.on_inject",
             "return dataclasses.replace(version, params=tuple(params))",
             "return version",
             ("tests/test_weight_prediction.py::test_prediction_equals_the_sequential_replay_of_the_predicted_versions",),
             "HetPipe computes Ŵ but minibatches run on the current W"),
    Mutation("wp_pipedream_stashes_unpredicted", "PerStageUpdate.forward_params",
             "params = self.predictor(params, self.vw.opt_states[stage_id], s, self.stage_updates[stage_id] - k)",
             "self.predictor(params, self.vw.opt_states[stage_id], s, self.stage_updates[stage_id] - k)",
             ("tests/test_weight_prediction.py::test_prediction_equals_the_sequential_replay_of_the_predicted_versions",),
             "PipeDream's stages compute Ŵ but forward (and stash) their unpredicted weights"),
    Mutation("wp_option_dropped", "update_settings",
             "weight_prediction=optim.weight_prediction,",
             "",
             ("tests/test_weight_prediction.py::test_virtual_time_run_records_the_settings",),
             "the job records weight_prediction='optimizer' but its VWs run without it"),
    Mutation("pipemare_no_warmup_cap", "pipemare_scale",
             "return float(tau) ** -(1.0 - min(t / warmup, 1.0))",
             "return float(tau) ** -(1.0 - t / warmup)",
             ("tests/test_weight_prediction.py::test_pipemare_scale_by_hand",),
             "PipeMare's exponent keeps falling after T: stale steps grow beyond the base rate"),
    Mutation("pipemare_hetpipe_tau_off_by_one", "PerMinibatchUpdate.on_complete",
             "tau = self.completed - self._completed_at_injection.pop(mb.record.minibatch_id)",
             "tau = self.completed - self._completed_at_injection.pop(mb.record.minibatch_id) + 1",
             ("tests/test_weight_prediction.py::test_pipemare_equals_the_replay_with_its_scaled_steps",),
             "HetPipe's PipeMare delay counts one update too many"),
    Mutation("pipemare_pipedream_tau_from_latest", "PerStageUpdate.stage_update",
             "tau, t = self.stage_updates[s] - mb.record.stage_versions[s], self.stage_updates[s]",
             "tau, t = self.stage_updates[s] - mb.record.stage_versions[0], self.stage_updates[s]",
             ("tests/test_weight_prediction.py::test_pipemare_equals_the_replay_with_its_scaled_steps",),
             "PipeDream's PipeMare delay of every stage is stage 0's"),
    Mutation("pipemare_option_dropped", "update_settings",
             "delay_scaled_lr=optim.delay_scaled_lr,",
             "",
             ("tests/test_weight_prediction.py::test_virtual_time_run_records_the_settings",),
             "the job records delay_scaled_lr='pipemare' but its VWs run without it"),
    # ---- the Job resolved once, one set-up for every driver
    Mutation("job_drops_pull_every_wave", "_build_job",
             "wsp=job_lib.WSPSettings(settings.staleness_bound, config.pull_every_wave, config.ps_apply),",
             "wsp=job_lib.WSPSettings(settings.staleness_bound, True, config.ps_apply),",
             ("tests/test_job_config.py::test_the_job_holds_every_flat_setting_as_given",),
             "the Job records config.pull_every_wave=False (config.json) but its VWs pull at every wave end"),
    Mutation("set_up_skips_resume_workdir_check", "set_up",
             "resume_lib.check_resume_workdir(workdir, job.resume)",
             "pass",
             ("tests/test_resume.py::test_resume_needs_checkpoints",),
             "the one set-up starts a --resume run in a workdir without checkpoints (from scratch)"),
    # ---- checkpoints with stage ranks and several PS shards
    Mutation("stage_rank_forgets_opt_state_on_resume", "stage_rank_vw",
             "resume(vw, ctx.point, vw_id)",
             "pass",
             ("tests/test_checkpoint_layouts.py::test_stage_ranks_and_shards_checkpoint_and_resume_onto_any_layout",),
             "a resumed stage rank starts its stages' optimizer state afresh instead of from the checkpoint"),
    Mutation("checkpoint_drops_stage_rank_opt_state", "merge_states",
             "state = template if rank not in buffers else state_from_bytes(np.asarray(buffers[rank], np.uint8), template)",
             "state = template if rank not in buffers or v in merged else state_from_bytes(np.asarray(buffers[rank], np.uint8), template)",
             ("tests/test_checkpoint_layouts.py::test_stage_ranks_and_shards_checkpoint_and_resume_onto_any_layout",),
             "the checkpoint keeps only the drivers' optimizer states: the stage ranks' layers get fresh ones"),
    Mutation("shard_cut_log_not_shifted", "_run_ps",
             "log += [(first + w, v) for w, v in seg_log]",
             "log += [(w, v) for w, v in seg_log]",
             ("tests/test_checkpoint_layouts.py::test_stage_ranks_and_shards_checkpoint_and_resume_onto_any_layout",),
             "a non-lead shard's log of a segment keeps the segment's own wave numbers (waves look applied twice)"),
    Mutation("segment_keeps_own_flat", "PerMinibatchUpdate.reset",
             "self.own_flat = {}",
             "",
             ("tests/test_checkpoint_layouts.py::test_stage_ranks_and_shards_checkpoint_and_resume_onto_any_layout",),
             "a segment starts with the last segment's own-wave copies (the barrier's weights already hold them)"),
    # ---- periodic evaluation with several PS shards
    Mutation("sharded_eval_before_all_slices", "ParameterServerService._finish_evals",
             "if len(slices) < layout.num_shards:",
             "if not slices:",
             ("tests/test_ps_shard_eval.py::test_sharded_lead_evaluates_the_slices_every_shard_held_when_its_clock_reached_c",),
             "the sharded lead evaluates at clock c before every shard's slice arrived (its own slice, zeros elsewhere)"),
    Mutation("sharded_lead_returns_before_evals", "ParameterServerService.run",
             "self._await_evals(status, MPI.ANY_SOURCE, backoff)",
             "pass",
             ("tests/test_ps_shard_eval.py::test_sharded_lead_evaluates_the_slices_every_shard_held_when_its_clock_reached_c",),
             "the sharded lead ends its segment with evaluations still waiting for slices: they are never made"),
    Mutation("checkpoint_scalars_from_a_stage_rank", "merge_states",
             "for rank in sorted(templates):",
             "for rank in sorted(templates, reverse=True):",
             ("tests/test_checkpoint_layouts.py::test_the_checkpoint_merges_each_vw_from_its_driver_and_stage_ranks_by_layer",),
             "a VW's shared optimizer scalars come from a stage rank, and a driver without state goes unnoticed"),
    Mutation("resume_shard_logs_ignore_layout", "resumed_shard_logs",
             "if old is not None and int(meta.get(\"num_ps_shards\", 1)) == num_shards:",
             "if old is not None:",
             ("tests/test_checkpoint_layouts.py::test_a_resume_continues_each_shards_log_or_the_leads_under_another_layout",),
             "a resume onto another shard count gives the new shards the old shards' logs (some shards none)"),
    Mutation("recovery_hang_over_earlier_kill", "diagnose",
             'if exits and hangs and exits[0]["time"] < hangs[0]["time"]:',
             "if False:",
             ("tests/test_recovery.py::test_a_hang_blamed_by_the_watchdog_comes_first_unless_a_rank_ended_before_and_a_"
              "config_error_is_not_restarted",),
             "a stage rank killed before the watchdog fired is blamed on its VW's driver (a hang): the drill smoke's "
             "CI failure of stop 31"),
    Mutation("restart_cache_skips_small_compiles", "compilation_cache_env",
             'out.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")',
             "pass",
             ("tests/test_launch.py::test_restarts_share_a_compilation_cache_that_the_user_can_name_or_turn_off",),
             "a restart's cache keeps JAX's 1 s threshold: no CPU stage program is cached, every restart compiles"),
    Mutation("restart_cache_overrides_the_users", "compilation_cache_env",
             "elif not out.get(CACHE_ENV):",
             "else:",
             ("tests/test_launch.py::test_restarts_share_a_compilation_cache_that_the_user_can_name_or_turn_off",),
             "--compilation_cache=auto replaces the cache directory the user set"),
    Mutation("muon_consistent_rms_ignored", "make_optimizer",
             "consistent_rms=optim.muon_consistent_rms or None))",
             "consistent_rms=None))",
             ("tests/test_optimizers.py::test_pipelined_vw_equals_whole_model_optax",),
             "config.muon_consistent_rms is recorded but Muon runs optax's width scaling"),
    Mutation("delay_sweep_off_by_one", "train_delayed",
             "used = max(0, p - v.delay)",
             "used = max(0, p - v.delay + 1)",
             ("tests/test_delay_sweep.py::test_the_closed_form_delay_is_a_hetpipe_vw_in_virtual_time",),
             "the sweep's closed form takes each gradient one update later than HetPipe's Nm - 1 delay"),
    Mutation("wp_muon_without_shape_scale", "muon_shape_scale",
             "return math.sqrt(max(fan_in, fan_out)) * consistent_rms",
             "return math.sqrt(max(fan_in, fan_out))",
             ("tests/test_weight_prediction.py::test_muon_prediction_is_optax_muons_step_when_its_momentum_stays",),
             "Muon's predicted step ignores its consistent RMS: a matrix moves sqrt(fan) times too far"),
    Mutation("wp_muon_adam_part_without_decay", "direction",
             "if opt.name in (\"nadamw\", \"muon\"):",
             "if opt.name in (\"nadamw\",):",
             ("tests/test_weight_prediction.py::test_muon_prediction_is_optax_muons_step_when_its_momentum_stays",),
             "Muon's Adam part predicts without the weight decay optax applies to it"),
    Mutation("wp_muon_matrices_as_adam", "_predict_muon.leaf",
             "if _is_masked(m_muon):",
             "if True:",
             ("tests/test_weight_prediction.py::test_muon_prediction_is_optax_muons_step_when_its_momentum_stays",),
             "Muon's matrices predicted with its Adam part's direction (an elementwise step, not orthogonalised)"),
    Mutation("wp_muon_not_passed_to_the_job", "optimizer_step",
             "muon_consistent_rms=optim.muon_consistent_rms)",
             "muon_consistent_rms=0.0)",
             ("tests/test_delay_sweep.py::test_the_closed_form_delay_is_a_hetpipe_vw_in_virtual_time",),
             "the job predicts Muon's step with width scaling while its optimizer uses the consistent RMS"),
    Mutation("clock_log_loss_not_averaged", "ClockLog.line",
             "self.loss = float(np.mean(self.losses))",
             "self.loss = float(self.losses[-1])",
             ("tests/test_clock_log.py::test_lines_and_evaluations_follow_the_clock_rule",),
             "a metrics line's loss is the last wave's, not the mean since the previous line"),
    Mutation("clock_log_eval_at_the_final_step", "ClockLog.eval_due",
             "return self.eval_every > 0 and clock % self.eval_every == 0 and (self.eval_before is None or clock < self.eval_before)",
             "return self.eval_every > 0 and clock % self.eval_every == 0 and (self.eval_before is None or clock <= self.eval_before)",
             ("tests/test_clock_log.py::test_a_line_without_new_losses_keeps_the_last_loss_and_eval_before_stops_evaluations",),
             "the flush methods evaluate their last step twice (in the loop and as the run's final evaluation)"),
    Mutation("clock_log_final_line_as_a_wave", "ClockLog.line",
             "    if not final:\n      line[\"wave\"] = clock - 1",
             "    if True:\n      line[\"wave\"] = clock - 1",
             ("tests/test_mpi_job.py::test_three_rank_run_writes_every_output",),
             "the run's final line looks like a wave's line (a reader counting waves counts it twice)"),
    Mutation("hetpipe_fit_takes_the_low_end", "fit",
             "      e, reached = math.exp(hi), True",
             "      e, reached = math.exp(lo), True",
             ("tests/test_calibration_hetpipe.py::test_fit_recovers_known_efficiencies_from_hetpipe_rates",),
             "the HetPipe-cell fit returns an efficiency whose rate falls short of the paper's (the bracket's low end)"),
    Mutation("hetpipe_fit_ignores_an_unreachable_cell", "fit",
             "    if r_hi < want:",
             "    if False:",
             ("tests/test_calibration_hetpipe.py::test_a_cell_out_of_reach_is_recorded_at_efficiency_one_not_reached",),
             "a cell even efficiency 1 cannot reach is bisected anyway and reported as reached"),
)


def _copy_repo(dest: pathlib.Path) -> None:
  for name in COPIED:
    src = REPO_ROOT / name
    if src.is_dir():
      shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    else:
      shutil.copy2(src, dest / name)
  (dest / ".venv").symlink_to(REPO_ROOT / ".venv")


def run_one(mutation: Mutation, timeout_s: int) -> dict:
  """Runs ``mutation``'s tests on a mutated copy (``mutation.old == mutation.new``: unmutated); returns its row."""
  t0 = time.perf_counter()
  row = {"name": mutation.name, "what": mutation.what, "where": mutation.where, "tests": list(mutation.tests)}
  with tempfile.TemporaryDirectory(prefix=f"mutation_{mutation.name}_") as tmp:
    root = pathlib.Path(tmp)
    _copy_repo(root)
    if mutation.old != mutation.new:
      try:
        row["file"] = apply(mutation, root).path
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
    index = Index(REPO_ROOT)
    rows = []
    for m in mutations:
      row = {"name": m.name, "where": m.where, "applies": True, "tests": list(m.tests), "what": m.what}
      try:
        scope, first, _ = locate(m, index)
        row["file"] = f"{scope.path}:{first}"
      except ValueError as e:
        row.update(applies=False, detail=str(e))
      rows.append(row)
    print(json.dumps(rows, indent=2))
    return
  t0 = time.perf_counter()
  if _BASELINE.value:
    tests = tuple(sorted({t for m in mutations for t in m.tests}))
    base = run_one(Mutation("baseline", "", "", "", tests, "no mutation"), 10 * _TIMEOUT_S.value)
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
