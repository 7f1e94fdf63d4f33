"""TRL plug-in: record every completion a `trl.GRPOTrainer` generates into a rollstore buffer, and
optionally let a rollstore recipe curate each generation batch before TRL's loss sees it.

Usage (see docs/trl.md):  `RollstoreGRPOTrainer(..., buffer="buf/", curate="dapo")` in place of
`GRPOTrainer(...)`. Tested against trl 1.16 (the `trl` extra pins `trl>=1.16,<2`).

Extension points used (no TRL code copied): a subclass overriding
`GRPOTrainer._calculate_rewards` (to keep the per-function rewards it returns) and
`GRPOTrainer._generate_and_score_completions` (to read, and under curation rewrite, the batch dict
it returns). Only training batches are recorded; evaluation batches pass through untouched.

Invariants:
- One `rollouts` row per completion of a training generation batch, every completion (the ones TRL
  trains on and the rest) of every process, appended as ONE shard per batch with
  `Buffer.append_rollouts`; rows are built by `rollout.build.build_rollouts`, so ids and groups
  follow its rules.
- Several processes (`accelerate launch`): only the main process opens the buffer. Each process
  scores its own completions, every process's rows are gathered to it in process order (TRL's
  order of the generation batch, whose rewards TRL gathers the same way), and the main process
  records and curates the whole batch once (one shard, one curation, one audit); its decisions
  are broadcast, so every process trains its slice with the same decisions. The run_id is the main
  process's.
- Groups: TRL's sampler repeats each prompt `num_generations` times consecutively, so rows
  g*G .. g*G+G-1 of a batch are group g (G = `num_generations`), across processes; a batch whose prompts break
  that rule is refused with one line. `step` = the index of the generation batch in the run, from
  TRL's counters (`global_step` x gradient accumulation / micro-steps per generation), so a run
  resumed from a checkpoint (`resume_from_checkpoint`) continues its numbering; never a step the
  run_id already has in the buffer (a batch generated after the checkpoint by the run that
  stopped keeps its step, the resumed ones follow). `policy_version` = TRL's `state.global_step`
  when the batch was generated.
- `response_token_ids` run up to and including the first EOS (`finish_reason` "stop"), else the
  whole completion ("length"); `prompt_token_ids` are TRL's prompt ids without left padding.
- `old_logprobs`: TRL's `old_per_token_logps` when TRL computed them, else one extra no-grad forward
  of the current policy through TRL's own `_get_per_token_logps_and_entropies` (tempered as TRL
  does); `entropies` (behind `record_entropies`, forced on under curation) come from that same
  forward. `gen_logprobs`: TRL's sampler log-probs (`sampling_per_token_logps`, vLLM) when present,
  else the old log-probs (the HF generation path samples from these very weights); `meta.gen_logprobs`
  says which.
- `reward` = TRL's weighted sum of the reward functions (`reward_weights`, NaN treated as 0, as
  TRL's logged reward); an unscorable completion (every function returned None) gets reward 0 and
  `verify_error` "unscorable". `meta.rewards` has one value per reward function (null for None),
  `meta.trl_advantage` the advantage TRL computed.
- `correct`: from ONE reward function, the one named by `correct_reward` (a name, or a `CorrectRule`
  with its threshold), or else the first whose attribute `rollstore_correct` is true: correct =
  (its reward >= the rule's `threshold`, default 1.0);
  null when no such function exists or it returned None. Curation needs it (a row without
  `correct` is `invalid` in the audit), so `curate` without such a function is refused. A row
  whose `correct` function returned None while another function scored it is therefore dropped
  under any recipe, `grpo` included, where plain TRL trains on it: a deliberate difference
  (rollstore does not invent a verdict), logged once per trainer as a warning.
- Curation (`curate` set): after recording, `curate.run.curate` runs over exactly this batch
  (`where run_id = ... AND step = ...`, `progress` = global_step / max_steps) and commits its
  curated rows and audit. The recipe's `std` follows TRL's `scale_rewards` ("none" -> none, else
  sample std), and the curated advantage is rescaled from rollstore's (std + 1e-6) to TRL's
  (std + 1e-4, std of the group or, under "batch", of the batch), so `curate="grpo"` trains exactly
  as plain TRL. TRL's batch then gets: `advantages` = curated advantage x TRL scale x weight (0 for a
  dropped row), and a loss mask = TRL's mask x the curated `loss_mask` (all zero for a dropped row),
  carried in TRL's `tool_mask` (a loss-only mask: attention is unchanged). `num_items_in_batch` is
  recounted over the curated mask. Normalisation is then TRL's own (docs/trl.md): under
  `loss_type="grpo"`/"sapo"/"luspo"/"dr_grpo" a dropped row still counts in the batch mean;
  under "bnpo", "dapo", "cispo", "vespo" it does not.
- Replay (a recipe whose `replay` is not "none"; one process only, refused otherwise): the curation
  runs with `current_version` = TRL's `global_step`, and the stored rows it chooses from earlier
  batches of the run enter TRL's batch, first in the slots of the fresh rows it dropped, then
  appended (plus masked filler rows to a multiple of `steps_per_generation`), with their stored
  token ids, the curated loss mask, their own group's advantage (TRL's scale) x weight, and the
  decoupled correction of learner/losses.py in TRL's terms: `old_per_token_logps` = π_prox (a
  no-grad forward of the current weights, TRL's clip is against it), and the per-token weight
  min(π_prox / π_behav, `decoupled_cap`) (π_behav = the stored `old_logprobs`; sequence level: the
  capped geometric mean) folded into a per-token advantage. A batch without replayed rows is
  unchanged by replay. The machinery, and its invariants in full, are in `rollstore.trl.replay`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import uuid
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)
import pyarrow.dataset as ds
import torch

try:
    from trl import GRPOTrainer
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("rollstore.trl needs TRL: pip install -e '.[trl]'") from exc

from rollstore.curate.params import Recipe, load_recipe, resolve, step_where
from rollstore.curate.prompts import refuse
from rollstore.curate.run import curate as run_curation
from rollstore.learner.losses import LossConfig
from rollstore.rollout.backends import FINISH_LENGTH, FINISH_STOP, Generation
from rollstore.rollout.build import StepStamp, build_rollouts
from rollstore.rollout.prompt_sources import Prompt, prompt_hash
from rollstore.rollout.reward import Verdict
from rollstore.storage.buffer import Buffer
from rollstore.storage.references import runs_to_mask

from .errors import TRLPluginError
from .replay import replay_into, stored_rows

__all__ = ["CorrectRule", "RollstoreGRPOTrainer", "TRLPluginError"]

SOURCE = "trl"


@dataclass(frozen=True)
class CorrectRule:
    """The `correct` rule with a threshold other than 1.0: `correct_reward=CorrectRule("acc", 0.5)`.
    `reward` names the reward function that decides `correct` (None: the first function with
    `rollstore_correct = True`); correct = its reward >= `threshold`. `correct_reward="acc"` is
    `CorrectRule("acc")`."""

    reward: str | None = None
    threshold: float = 1.0


def _open_buffer(buffer: str | Buffer) -> Buffer:
    if isinstance(buffer, Buffer):
        return buffer
    if os.path.isdir(buffer) and os.listdir(buffer):
        return Buffer.open(buffer)
    return Buffer.init(buffer)


def _prompt_text(prompt) -> str:
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, default=str)


def _finite(x: float) -> float | None:
    return None if x is None or math.isnan(x) else float(x)


class RollstoreGRPOTrainer(GRPOTrainer):
    """`GRPOTrainer` that records each training generation batch into `buffer` (a path or a `Buffer`)
    and, with `curate` (a built-in recipe name, a .toml/.sql recipe path, or a `Recipe`), trains on
    the rollstore-curated batch. `curate_sets`: recipe parameter overrides (not `where`/`progress`).
    `correct_reward`: the reward function that decides `correct`, by name, or a `CorrectRule` (name
    and threshold); `gold_column`: the dataset column recorded as `gold_answer`; `decoupled_cap`:
    replay's weight cap (`rollstore.trl.replay`).
    """

    def __init__(
        self,
        *args,
        buffer: str | Buffer,
        run_id: str | None = None,
        curate: str | Recipe | None = None,
        curate_sets: dict | None = None,
        record_entropies: bool = False,
        correct_reward: str | CorrectRule | None = None,
        gold_column: str = "answer",
        decoupled_cap: float = LossConfig().decoupled_cap,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        # only the main process opens the buffer; every process holds the same run_id
        self.rollstore_buffer = _open_buffer(buffer) if self.accelerator.is_main_process else None
        self.rollstore_run_id = self._same_everywhere(run_id or f"trl-{uuid.uuid4().hex[:12]}")
        self.rollstore_recipe = load_recipe(curate) if isinstance(curate, str) else curate
        self.rollstore_sets = dict(curate_sets or {})
        for reserved in ("where", "progress", "std"):
            if reserved in self.rollstore_sets:
                raise TRLPluginError(f"curate_sets: {reserved} is set by the TRL plug-in "
                                     f"({'from GRPOConfig.scale_rewards' if reserved == 'std' else 'for each batch'})")
        if self.rollstore_recipe is not None and getattr(self, "multi_objective_aggregation", "sum_then_normalize") \
                != "sum_then_normalize":
            raise TRLPluginError("curate= needs multi_objective_aggregation='sum_then_normalize' (rollstore curates "
                                 "the summed reward)")
        effective = resolve(self.rollstore_recipe, self.rollstore_sets) if self.rollstore_recipe is not None else None
        if effective is not None:
            refuse(effective, "the TRL plug-in")
        self.rollstore_replay = effective is not None and effective["replay"] != "none"
        self.rollstore_cap = float(decoupled_cap)
        if self.rollstore_replay:
            self._check_replay_supported()
        self.rollstore_entropies = record_entropies or self.rollstore_recipe is not None
        rule = correct_reward if isinstance(correct_reward, CorrectRule) else CorrectRule(correct_reward)
        self.rollstore_correct_index = self._correct_index(rule.reward)
        self.rollstore_threshold = float(rule.threshold)
        if self.rollstore_recipe is not None and self.rollstore_correct_index is None:
            raise TRLPluginError("curation needs `correct` (rows without it are `invalid`): pass correct_reward=NAME "
                                 "or mark a reward function with rollstore_correct = True")
        self.rollstore_gold_column = gold_column
        self.rollstore_batches = 0  # generation batches recorded by this trainer object
        self._rollstore_next: int | None = None  # the lowest step free in the buffer for this run_id
        self._rollstore_warned = False
        # each curated batch, in order: its CurationResult on the main process, its curation_id elsewhere
        self.rollstore_curations: list = []
        self._rollstore_rewards = None
        self.rollstore_last_ids: list[str] = []  # rollout ids of this process's rows of the last batch
        # replay: per row of the last batch TRL trains on, its rollout id (None: a filler row), and the
        # ids of the rows replayed into it from earlier batches
        self.rollstore_last_rows: list[str | None] = []
        self.rollstore_last_replayed: list[str] = []
        self.rollstore_last_advantages: list[float] = []  # per row, before replay's decoupled weight
        self._rollstore_own_logps = None

    def _check_replay_supported(self) -> None:
        """Replay inside TRL: one process, text only, a reference model when beta != 0."""
        if "current_version" in self.rollstore_sets:
            raise TRLPluginError("curate_sets: current_version is set by the TRL plug-in under replay "
                                 "(TRL's global_step)")
        if self.accelerator.num_processes > 1:
            raise TRLPluginError(f"replay recipes run in one process inside TRL (this run has "
                                 f"{self.accelerator.num_processes}): curate without replay, or replay offline with "
                                 f"`rollstore loop` (docs/trl.md, Replay)")
        if self.beta != 0.0 and self.ref_model is None:
            raise TRLPluginError("replay with beta != 0 needs a separate reference model (a PEFT adapter's "
                                 "reference is not supported): set beta=0 or curate without replay")
        if not self.rollstore_cap > 0:
            raise TRLPluginError(f"decoupled_cap must be > 0, got {self.rollstore_cap}")

    def _same_everywhere(self, value):
        """The main process's `value`, on every process."""
        if self.accelerator.num_processes == 1:
            return value
        from accelerate.utils import broadcast_object_list

        return broadcast_object_list([value], from_process=0)[0]

    def _correct_index(self, name: str | None) -> int | None:
        if name is not None:
            if name not in self.reward_func_names:
                raise TRLPluginError(f"correct_reward={name!r} is not a reward function ({', '.join(self.reward_func_names)})")
            return self.reward_func_names.index(name)
        for i, func in enumerate(self.reward_funcs):
            if getattr(func, "rollstore_correct", False):
                return i
        return None

    # -- TRL extension points -------------------------------------------------------------------

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._rollstore_rewards = rewards.detach().float().cpu()  # gathered: every process's rows
        return rewards

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if not self.model.training:
            return output
        local = self._local_rows(inputs, output)
        n_local = len(local)
        if self.accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            rows = gather_object(local)  # every process's rows, in process order: TRL's batch order
        else:
            rows = local
        decision, failure = None, None
        if self.accelerator.is_main_process:
            try:
                step = self._next_step()
                ids = self._record(rows, step)
                decision = {"step": step, "ids": ids}
                if self.rollstore_recipe is not None:
                    decision.update(self._curate(rows, ids, step))
            except Exception as exc:  # the other processes wait in the broadcast: tell them, then raise
                failure = exc
                decision = {"error": f"{type(exc).__name__}: {exc}"}
        decision = self._same_everywhere(decision)
        if failure is not None:
            raise failure
        if "error" in decision:
            raise TRLPluginError(f"the main process could not record or curate this batch: {decision['error']}")
        first = self.accelerator.process_index * n_local
        self.rollstore_last_ids = decision["ids"][first:first + n_local]
        self.rollstore_batches += 1
        if self.rollstore_recipe is not None:
            if not self.accelerator.is_main_process:
                self.rollstore_curations.append(decision["curation_id"])
            self._apply(output, decision, first, [r["length"] for r in local])
            self.rollstore_last_rows = list(self.rollstore_last_ids)
            self.rollstore_last_replayed = []
            self.rollstore_last_advantages = [float(a) for a in output["advantages"].tolist()]
            if decision.get("replayed"):
                replay_into(self, output, decision)
        return output

    # -- recording --------------------------------------------------------------------------------

    def _next_step(self) -> int:
        """The step of the batch being recorded: the generation batch index TRL's counters give
        (optimizer steps done x gradient accumulation + the micro-step, over the micro-steps per
        generation), so a run resumed from a checkpoint continues its numbering; never below a step
        this run_id already has in the buffer (batches generated after that checkpoint by the run
        that stopped keep their rows and steps; the resumed batches come after them)."""
        if self._rollstore_next is None:
            with self.rollstore_buffer.snapshot() as snap:
                steps = snap.arrow("rollouts").to_table(
                    filter=ds.field("run_id") == self.rollstore_run_id, columns=["step"]).column("step")
            self._rollstore_next = 0 if len(steps) == 0 else int(pa.compute.max(steps).as_py()) + 1
        ga = int(self.args.gradient_accumulation_steps)
        micro = int(self.state.global_step) * ga + (int(getattr(self, "_step", 0)) % ga)
        every = int(self.args.steps_per_generation) * int(self.num_iterations)
        step = max(micro // every, self._rollstore_next)
        self._rollstore_next = step + 1
        return step

    def _forward_scores(self, output) -> tuple[torch.Tensor, torch.Tensor | None]:
        ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        with torch.no_grad():
            logps, ent, _ = self._get_per_token_logps_and_entropies(
                self.model, ids, mask, output["completion_ids"].size(1),
                batch_size=self.args.per_device_train_batch_size, compute_entropy=self.rollstore_entropies,
            )
        return logps, ent

    def _lengths(self, completion_ids: torch.Tensor) -> tuple[list[int], list[str]]:
        eos = set(int(e) for e in self.eos_token_ids)
        lengths, finish = [], []
        for row in completion_ids.tolist():
            cut = next((t + 1 for t, tok in enumerate(row) if tok in eos), None)
            lengths.append(len(row) if cut is None else cut)
            finish.append(FINISH_LENGTH if cut is None else FINISH_STOP)
        return lengths, finish

    def _local_rows(self, inputs, output) -> list[dict]:
        """This process's completions as plain values (what the main process records)."""
        lengths, finish = self._lengths(output["completion_ids"])
        own_logps, entropies = None, None
        if "old_per_token_logps" not in output or self.rollstore_entropies:
            own_logps, entropies = self._forward_scores(output)  # every process scores its own rows
        self._rollstore_own_logps = own_logps  # the fresh rows' ratio base when rows are replayed into the batch
        old = output.get("old_per_token_logps")
        old = (own_logps if old is None else old).float().cpu().numpy()
        sampled = output.get("sampling_per_token_logps")
        gen = old if sampled is None else sampled.float().cpu().numpy()
        ent = None if entropies is None else entropies.float().cpu().numpy()
        p_ids = output["prompt_ids"].cpu()
        p_mask = output["prompt_mask"].cpu().bool()
        c_ids = output["completion_ids"].cpu()
        advantages = output["advantages"].float().cpu()
        decode = getattr(self.processing_class, "decode", None)
        rows = []
        for i, x in enumerate(inputs):
            n = lengths[i]
            resp = c_ids[i, :n].tolist()
            gold = x.get(self.rollstore_gold_column)
            rows.append({
                "prompt": _prompt_text(x["prompt"]), "gold": None if gold is None else str(gold),
                "prompt_ids": p_ids[i][p_mask[i]].tolist(), "response_ids": resp,
                "text": decode(resp, skip_special_tokens=True) if decode is not None else "",
                "gen": gen[i, :n].astype(np.float32), "old": old[i, :n].astype(np.float32),
                "ent": None if ent is None else ent[i, :n].astype(np.float32), "finish": finish[i],
                "length": n, "trl_advantage": float(advantages[i]),
                "gen_source": "sampler" if sampled is not None else "old_logprobs",
            })
        return rows

    def _record(self, rows: list[dict], step: int) -> list[str]:
        """Append the whole generation batch (every process's rows) as one shard; main process only."""
        G = self.num_generations
        B = len(rows)
        if B % G:
            raise TRLPluginError(f"batch of {B} completions is not whole groups of num_generations={G}")
        for g in range(B // G):
            if len({r["prompt"] for r in rows[g * G:(g + 1) * G]}) != 1:
                raise TRLPluginError(f"rows {g * G}..{g * G + G - 1} of the batch are not one prompt's group")
        per_func = self._rollstore_rewards
        if per_func is None or per_func.shape[0] != B:
            raise TRLPluginError("TRL's per-function rewards were not seen for this batch")
        weights = self.reward_weights.float().cpu()
        summed = torch.nan_to_num(per_func * weights.unsqueeze(0), nan=0.0).sum(dim=1)
        unscorable = torch.isnan(per_func).all(dim=1)
        trl_rewards = (per_func * weights.unsqueeze(0)).nansum(dim=1)  # as TRL sums them (float32)
        trl_rewards[unscorable] = torch.nan
        prompts, gens, verdicts, olds, ents, metas = [], [], [], [], [], []
        with_ent = all(r["ent"] is not None for r in rows)
        for g in range(B // G):
            first = rows[g * G]
            prompts.append(Prompt(prompt_hash(first["prompt"]), first["prompt"], first["gold"], SOURCE))
            gens.append([]), verdicts.append([]), olds.append([]), ents.append([])
            for i in range(g * G, (g + 1) * G):
                r = rows[i]
                gens[-1].append(Generation(prompt_token_ids=r["prompt_ids"], response_token_ids=r["response_ids"],
                                           text=r["text"], gen_logprobs=r["gen"], finish_reason=r["finish"]))
                olds[-1].append(r["old"])
                ents[-1].append(r["ent"])
                correct = None
                if self.rollstore_correct_index is not None:
                    v = float(per_func[i, self.rollstore_correct_index])
                    correct = None if math.isnan(v) else v >= self.rollstore_threshold
                verdicts[-1].append(Verdict(correct, 0.0 if unscorable[i] else float(summed[i]),
                                            "unscorable" if unscorable[i] else None))
                metas.append(json.dumps({
                    "rewards": {name: _finite(float(per_func[i, k])) for k, name in enumerate(self.reward_func_names)},
                    "trl_advantage": r["trl_advantage"],
                    "gen_logprobs": r["gen_source"],
                    "trl_global_step": int(self.state.global_step),
                    "trl_process": i * self.accelerator.num_processes // B,
                }, sort_keys=True))
        table = build_rollouts(prompts, gens, verdicts,
                               StepStamp(self.rollstore_run_id, step, int(self.state.global_step)), old_logprobs=olds,
                               entropies=ents if with_ent else None)
        table = table.set_column(table.schema.get_field_index("meta"), table.schema.field("meta"), pa.array(metas, pa.string()))
        self.rollstore_buffer.append_rollouts(table, source=f"trl:{self.rollstore_run_id}:batch{step}")
        self._rollstore_trl_rewards = trl_rewards
        flat = [v for group in verdicts for v in group]
        self._rollstore_eligible = [not bool(unscorable[i]) and flat[i].correct is not None for i in range(B)]
        self._rollstore_rewards = None
        return table.column("rollout_id").to_pylist()

    # -- curation ---------------------------------------------------------------------------------

    def _trl_scale(self, B: int) -> list[float]:
        """Per row, the factor that turns rollstore's advantage scale into TRL's: rollstore divides
        (r - mean) by (group std + 1e-6), TRL by (std + 1e-4), with std per `scale_rewards`
        ("group": the group's, "batch": the whole generation batch's, TRL's `nanstd`; "none": no
        division, and the recipe runs with std = none, factor 1). rollstore's std is over the
        group's rows curation can use (scorable, with a verdict), in float64, sample std."""
        return self._scale_factors(self._rollstore_trl_rewards, self._rollstore_eligible)[:B]

    def _scale_factors(self, rewards: torch.Tensor, eligible: list[bool]) -> list[float]:
        """`_trl_scale` for one generation batch given its rewards (NaN: unscorable, as TRL sums
        them) and which rows curation can use, in TRL's order (groups of G consecutive rows)."""
        from trl.trainer.utils import nanstd

        B = len(eligible)
        if self.scale_rewards == "none":
            return [1.0] * B
        G = self.num_generations
        batch_std = float(nanstd(rewards)) if self.scale_rewards == "batch" else None
        out = []
        for g in range(B // G):
            rows = range(g * G, (g + 1) * G)
            trl_std = batch_std if batch_std is not None else float(nanstd(rewards[g * G:(g + 1) * G]))
            used = [float(rewards[i]) for i in rows if eligible[i]]
            if len(used) > 1:
                mean = math.fsum(used) / len(used)
                ours = math.sqrt(math.fsum((r - mean) ** 2 for r in used) / (len(used) - 1))
            else:
                ours = 0.0
            factor = (ours + 1e-6) / (trl_std + 1e-4) if trl_std == trl_std else 1.0
            out.extend([factor] * G)
        return out

    def _curate(self, rows: list[dict], ids: list[str], step: int) -> dict:
        """Curate the recorded batch (main process): one curation, one audit, over every process's
        rows. Returns, per row of the batch, the advantage TRL trains with (curated advantage x
        TRL's scale x weight; 0 when dropped) and the loss mask (empty when dropped)."""
        max_steps = max(int(self.state.max_steps or 0), 1)
        progress = Fraction(min(int(self.state.global_step), max_steps), max_steps)
        sets = dict(self.rollstore_sets)
        sets["where"] = step_where(self.rollstore_run_id, step)
        sets["progress"] = progress
        sets["std"] = "none" if self.scale_rewards == "none" else "sample"
        if self.rollstore_replay:  # the window is the run's rows of the last replay_window optimizer steps
            sets["current_version"] = int(self.state.global_step)
        result = run_curation(self.rollstore_buffer, self.rollstore_recipe, sets)
        self.rollstore_curations.append(result)
        with self.rollstore_buffer.snapshot() as snap:
            stored = snap.arrow("curated", resolved=False).to_table(  # the stored mask: kept runs
                filter=ds.field("curation_id") == result.curation_id,
                columns=["rollout_id", "advantage", "weight", "keep_runs", "tokens"])
            curated = stored.append_column("loss_mask", runs_to_mask(
                stored.column("keep_runs"), stored.column("tokens").to_numpy())).to_pylist()
        no_verdict = sum(1 for i, ok in enumerate(self._rollstore_eligible)
                         if not ok and not math.isnan(float(self._rollstore_trl_rewards[i])))
        if no_verdict and not self._rollstore_warned:
            self._rollstore_warned = True
            logging.getLogger("rollstore.trl").warning(
                "%d completion(s) of batch %d have no verdict (the correct_reward function returned None): curation "
                "drops them as `invalid`, where plain TRL trains on them with the other rewards (docs/trl.md, "
                "None rewards)", no_verdict, step)
        index = {rid: i for i, rid in enumerate(ids)}
        scale = self._trl_scale(len(ids))
        advantages = [0.0] * len(ids)
        masks: list[list[int]] = [[] for _ in ids]
        replayed = []
        for row in curated:
            i = index.get(row["rollout_id"])
            if i is None:
                if not self.rollstore_replay:
                    raise TRLPluginError(f"curation {result.curation_id} returned {row['rollout_id']}, "
                                         "not of this batch")
                replayed.append(row)
                continue
            if len(row["loss_mask"]) != rows[i]["length"]:
                raise TRLPluginError(f"{row['rollout_id']}: curated loss_mask has {len(row['loss_mask'])} tokens, "
                                     f"completion {rows[i]['length']}")
            advantages[i] = float(row["advantage"]) * scale[i] * float(row["weight"])
            masks[i] = [int(m) for m in row["loss_mask"]]
        out = {"curation_id": result.curation_id, "advantages": advantages, "masks": masks}
        if replayed:
            out["replayed"] = stored_rows(self, replayed)
        return out

    def _apply(self, output, decision: dict, first: int, lengths: list[int]) -> None:
        """Rewrite this process's slice of the batch with the curated decisions (the same on every
        process: they come from the main process's one curation)."""
        advantages = torch.zeros_like(output["advantages"])
        keep = torch.zeros_like(output["completion_mask"])
        for j, n in enumerate(lengths):
            mask = decision["masks"][first + j]
            advantages[j] = decision["advantages"][first + j]
            if mask:
                keep[j, :n] = torch.tensor(mask, dtype=keep.dtype)
        output["advantages"] = advantages
        tool_mask = output.get("tool_mask")
        output["tool_mask"] = keep if tool_mask is None else tool_mask * keep
        loss_mask = output["completion_mask"] * output["tool_mask"]
        output["num_items_in_batch"] = self.accelerator.gather(loss_mask.sum()).sum()
