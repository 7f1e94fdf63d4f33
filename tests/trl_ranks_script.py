"""Run under `accelerate launch --cpu --num_processes 2` by tests/test_trl.py (the `rank` tests):
a RollstoreGRPOTrainer on the tiny model, 2 optimizer steps, groups that straddle the two
processes (6 completions per process, num_generations 4). Each process writes what it trained on
(its rollout ids, the advantages and loss-mask token counts TRL's loss saw, its completion ids) to
OUT/rank{R}.json.

usage: trl_ranks_script.py MODEL_DIR BUFFER OUT RECIPE
(a recipe the plug-in refuses in several processes, a replay recipe, writes {"refused": message}.)
"""

from __future__ import annotations

import json
import os
import sys

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rollstore.trl import RollstoreGRPOTrainer, TRLPluginError  # noqa: E402

G = 4


def parity(completions, completion_ids, prompts, **kw):
    return [1.0 if p == "1+1=" else float(len(c) % 2 == 0) for p, c in zip(prompts, completion_ids)]


parity.rollstore_correct = True


def shaping(completions, completion_ids, **kw):
    return [0.01 * len(c) for c in completion_ids]


class Spy(RollstoreGRPOTrainer):
    seen: list = []

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        if self.model.training:
            mask = out["completion_mask"] * out.get("tool_mask", torch.ones_like(out["completion_mask"]))
            self.seen.append({"ids": list(self.rollstore_last_ids), "advantages": out["advantages"].tolist(),
                              "kept_tokens": mask.sum(-1).tolist(), "num_items": int(out["num_items_in_batch"]),
                              "completion_ids": [row[: int(n)] for row, n in zip(out["completion_ids"].tolist(),
                                                                                  out["completion_mask"].sum(-1).tolist())]})
        return out


def main(model_dir: str, buf: str, out: str, recipe: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    texts = ["1+1=", "2+3=", "4*2=", "9-5=", "7+1=", "3*3="]
    ds = Dataset.from_list([{"prompt": t, "answer": str(i)} for i, t in enumerate(texts)])
    cfg = GRPOConfig(output_dir=os.path.join(out, "trl"), num_generations=G, per_device_train_batch_size=6,
                     max_completion_length=6, max_steps=2, learning_rate=1e-3, logging_steps=1, report_to=[],
                     save_strategy="no", use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True)
    try:
        tr = Spy(model=model, reward_funcs=[parity, shaping], args=cfg, train_dataset=ds, processing_class=tok,
                 buffer=buf, run_id="ranks", curate=None if recipe == "none" else recipe)
    except TRLPluginError as exc:  # a replay recipe: refused in several processes
        rank = int(os.environ.get("RANK", "0"))
        with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
            json.dump({"rank": rank, "refused": str(exc)}, fh)
        return
    tr.train()
    rank = tr.accelerator.process_index
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump({"rank": rank, "processes": tr.accelerator.num_processes, "run_id": tr.rollstore_run_id,
                   "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
                   "batches": Spy.seen,
                   "curations": [c if isinstance(c, str) else c.curation_id for c in tr.rollstore_curations]}, fh)


if __name__ == "__main__":
    main(*sys.argv[1:5])
    # Leave without tearing the process down: once in CI, rank 0 aborted at exit ("terminate called
    # without an active exception", SIGABRT) after its work was done; accelerate leaves the gloo
    # group to the interpreter's teardown. What the test checks is on disk by now (the JSON above,
    # the buffer's committed shards), and the exit status stays the test's signal.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
