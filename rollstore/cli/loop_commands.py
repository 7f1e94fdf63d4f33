"""The commands of the loop: generate, train, loop, eval, demo.

Invariants: as `rollstore/cli/app.py`; `generate` and `train` call the front door
(`rollstore.open(BUF).generate` / `.train`); `train --nproc N` starts the learner's named entry
under torchrun (`rollstore.loop.learner_main`).
"""

from __future__ import annotations

import os
from typing import List, Optional

import typer

from rollstore import rules
from rollstore.cli.app import app, err, fail, front_door, guarded, out, _losses
from rollstore.cli.options import choice, count, positive, ruled, seed as seed_
from rollstore.rules.defaults import GENERATE, RECIPE, TRAIN


@app.command()
@guarded
def generate(
    buffer: str,
    prompts: str = typer.Option(GENERATE.prompts, "--prompts", help="JSONL/Parquet prompts file or builtin:arith[:split]."),
    model: str = typer.Option(GENERATE.model, "--model", help="A local transformers model directory, builtin:tiny, or checkpoint:latest | checkpoint:N (a checkpoint of this buffer)."),
    backend: str = typer.Option(GENERATE.backend, "--backend", help="hf | vllm"),
    group_size: int = ruled(GENERATE.group_size, "--group-size", "-G", rule=rules.GENERATE["group_size"]),
    num_prompts: Optional[int] = ruled(GENERATE.num_prompts, "--num-prompts", "-n", rule=rules.GENERATE["num_prompts"]),
    policy_version: Optional[int] = ruled(None, "--policy-version", rule=rules.GENERATE["policy_version"], help="Default: the checkpoint's version, else 0."),
    seed: int = ruled(GENERATE.seed, "--seed", rule=rules.GENERATE["seed"]),
    steps: int = ruled(GENERATE.steps, "--steps", rule=rules.GENERATE["steps"], help="Generation steps to run (one shard each)."),
    run_id: str = typer.Option(GENERATE.run_id, "--run-id"),
    max_new_tokens: int = ruled(GENERATE.max_new_tokens, "--max-new-tokens", rule=rules.GENERATE["max_new_tokens"]),
    temperature: float = ruled(GENERATE.temperature, "--temperature", rule=rules.GENERATE["temperature"]),
    top_p: float = ruled(GENERATE.top_p, "--top-p", rule=rules.GENERATE["top_p"]),
    template: Optional[str] = typer.Option(None, "--template", help="Chat template: a format string with {prompt}."),
    follow: bool = typer.Option(False, "--follow", help="Keep generating; load each newly published checkpoint."),
    max_policy_lag: int = ruled(GENERATE.max_policy_lag, "--max-policy-lag", rule=rules.GENERATE["max_policy_lag"], help="With --follow: wait while the learner is this many versions behind."),
    compact_entropies: bool = typer.Option(False, "--compact-entropies"),
    recipe: str = typer.Option(GENERATE.recipe, "--recipe", help="With --follow: the recipe that curates each step."),
    set_: List[str] = typer.Option([], "--set", help="With --follow: curation parameter overrides."),
):
    """Sample groups of responses, judge them with math-verify, score them, append one shard per step."""
    from rollstore.curate.params import parse_sets

    front_door(buffer, err).generate(
        prompts=prompts, model=model, num_prompts=num_prompts, group_size=group_size, steps=steps,
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, run_id=run_id,
        policy_version=policy_version, backend=backend, template=template, compact_entropies=compact_entropies,
        follow=follow, max_policy_lag=max_policy_lag, recipe=recipe, sets=parse_sets(set_))


@app.command()
@guarded
def train(
    buffer: str,
    curation: List[str] = typer.Option([], "--curation", help="Curation id(s) to train on (default: all pending)."),
    model: str = typer.Option(TRAIN.model, "--model"),
    loss: str = choice(TRAIN.loss, "--loss", choices=_losses, help="grpo | dapo | gspo | dr_grpo"),
    lr: float = ruled(TRAIN.lr, "--lr", rule=rules.TRAIN["lr"]),
    epochs: int = ruled(TRAIN.epochs, "--epochs", rule=rules.TRAIN["epochs"]),
    micro_batch_size: int = ruled(TRAIN.micro_batch_size, "--micro-batch-size", rule=rules.TRAIN["micro_batch_size"]),
    grad_accum: int = ruled(TRAIN.grad_accum, "--grad-accum", rule=rules.TRAIN["grad_accum"]),
    run_id: str = typer.Option(TRAIN.run_id, "--run-id"),
    follow: bool = typer.Option(False, "--follow", help="Keep leasing curations as they appear."),
    poll: float = ruled(TRAIN.poll, "--poll", rule=rules.TRAIN["poll"], help="Seconds between polls with --follow."),
    max_idle: float = ruled(TRAIN.max_idle, "--max-idle", rule=rules.TRAIN["max_idle"], help="With --follow: stop after this many idle seconds (0 = never)."),
    parallel: str = choice(TRAIN.parallel, "--parallel", choices=("none", "ddp", "fsdp"), help="none | ddp | fsdp (under torchrun, or with --nproc)."),
    nproc: int = count(0, "--nproc", low=0, help="Launch this many ranks with torchrun (default --parallel ddp)."),
    keep_checkpoints: int = ruled(TRAIN.keep_checkpoints, "--keep-checkpoints", rule=rules.TRAIN["keep_checkpoints"],
                                  help="Only the newest K checkpoints of the run keep their files (their rows, "
                                  "lineage and ledger stay; docs/loop.md)."),
):
    """Train on curated shards exactly once each; publish a checkpoint per curation.

    --micro-batch-size x --grad-accum is the global batch of one optimiser step, whatever the
    number of ranks; each rank trains its block of it in micro-batches of --micro-batch-size."""
    if nproc > 1 and "LOCAL_RANK" not in os.environ:  # a learner of N processes: torchrun's
        import subprocess

        from rollstore.loop import learner_main
        from rollstore.loop.learner_loop import check_curations
        from rollstore.rules.defaults import train_config

        if curation:
            check_curations(buffer, curation)
        config = train_config(loss=loss, lr=lr, epochs=epochs, micro_batch_size=micro_batch_size,
                              grad_accum=grad_accum)
        learner = learner_main.spec(buffer, model, config, run_id, curation, follow=follow, poll=poll,
                                    max_idle=max_idle, parallel="ddp" if parallel == "none" else parallel,
                                    keep_checkpoints=keep_checkpoints)
        raise typer.Exit(subprocess.call(learner_main.command(nproc, learner)))
    front_door(buffer).train(curation, model=model, loss=loss, lr=lr, epochs=epochs, micro_batch_size=micro_batch_size,
                             grad_accum=grad_accum, run_id=run_id, keep_checkpoints=keep_checkpoints, follow=follow,
                             poll=poll, max_idle=max_idle, parallel=parallel)


@app.command()
@guarded
def loop(
    buffer: str,
    model: Optional[str] = typer.Option(None, "--model", help="Default: the built-in policy of a built-in task "
                                        "(builtin:tiny-carries for builtin:carries), else builtin:tiny."),
    prompts: Optional[str] = typer.Option(None, "--prompts", help="Default builtin:arith (builtin:carries: the "
                                          "harder task)."),
    iterations: Optional[int] = count(None, "--iterations", "-k", show_default="40"),
    recipe: Optional[str] = typer.Option(None, "--recipe", "-r", help="Default d3s (recommended for long reasoning chains; grpo for short answers: `rollstore recipes`)."),
    set_: List[str] = typer.Option([], "--set", help="Curation parameter override name=value (repeatable)."),
    prompts_per_iter: Optional[int] = count(None, "--prompts-per-iter", show_default="128"),
    pool_size: Optional[int] = count(None, "--pool-size", low=0, help="Train on a pool of N prompts in epochs (0: fresh prompts).", show_default="2048"),
    group_size: Optional[int] = count(None, "--group-size", "-G", show_default="8"),
    max_new_tokens: Optional[int] = count(None, "--max-new-tokens", show_default="8",
                                         help="Tokens sampled per response (a built-in task's own budget: builtin:chains 40)."),
    loss: Optional[str] = choice(None, "--loss", choices=_losses, show_default="grpo"),
    lr: Optional[float] = ruled(None, "--lr", rule=rules.TRAIN["lr"], help="Learning rate (default: the recipe's `lr`, else 5e-5)."),
    epochs: Optional[int] = ruled(None, "--epochs", rule=rules.TRAIN["epochs"], help="Passes over each curated batch, μ (default: the recipe's "
                                  "`epochs`, else 1)."),
    warmup_steps: Optional[int] = count(None, "--warmup-steps", low=0, show_default="5"),
    micro_batch_size: Optional[int] = ruled(None, "--micro-batch-size", rule=rules.TRAIN["micro_batch_size"], show_default="512"),
    grad_accum: Optional[int] = ruled(None, "--grad-accum", rule=rules.TRAIN["grad_accum"], help="Micro-batches per optimiser step.", show_default="1"),
    max_policy_lag: Optional[int] = count(None, "--max-policy-lag", low=0, show_default="none: no bound"),
    max_gen_batches: Optional[int] = count(None, "--max-gen-batches", show_default="8"),
    eval_every: Optional[int] = count(None, "--eval-every", low=0, help="Held-out evaluation every N iterations (0 = never).", show_default="5"),
    eval_prompts: Optional[int] = count(None, "--eval-prompts", help="Distinct held-out prompts per evaluation.", show_default="500"),
    eval_samples: int = count(0, "--eval-samples", low=0, help="Also sample N per prompt for pass@1 / pass@N."),
    seed: int = seed_(0, "--seed"),
    run_id: Optional[str] = typer.Option(None, "--run-id", show_default="loop-RECIPE-sSEED"),
    backend: Optional[str] = typer.Option(None, "--backend", show_default="hf"),
    threads: Optional[int] = count(None, "--threads", help="torch threads (default 1: see docs/loop.md, Threads)."),
    learner_ranks: int = count(1, "--learner-ranks", help="Train with N torch.distributed ranks (DDP, torchrun)."),
    keep_checkpoints: int = count(3, "--keep-checkpoints", help="Only the newest K checkpoints keep their files "
                                  "(and those a replay window needs; rows, lineage and ledger stay; docs/loop.md)."),
    compact_every: int = ruled(100, "--compact-every", rule=rules.LOOP["compact_every"],
                               help="Merge the run's small shards every N iterations (0 = never; docs/loop.md)."),
):
    """The near-on-policy loop: generate → score → append → curate → train → publish → repeat.

    Options left out take the defaults of `rollstore.loop.LoopConfig` (the demo's settings)."""
    from dataclasses import replace

    from rollstore.curate.params import parse_sets
    from rollstore.loop.driver import LoopConfig
    from rollstore.loop.view import run_with_display
    from rollstore.storage.buffer import Buffer

    def given(**kw):
        return {k: v for k, v in kw.items() if v is not None}

    defaults = LoopConfig(buffer=buffer, **given(prompts=prompts))  # a built-in task's token budget
    if model is None and prompts is not None:
        from rollstore.builtin.resolve import task_model

        model = task_model(prompts)
    cfg = LoopConfig(
        buffer=buffer, sets=parse_sets(set_), eval_samples=eval_samples, seed=seed,
        eval_ks=(1, eval_samples) if eval_samples else (1,),
        generation=replace(defaults.generation, **given(group_size=group_size, max_new_tokens=max_new_tokens,
                                                        backend=backend)),
        train=replace(defaults.train, **given(loss=loss, warmup_steps=warmup_steps,
                                              micro_batch_size=micro_batch_size, grad_accum=grad_accum)),
        **given(lr=lr, epochs=epochs, model=model, prompts=prompts, iterations=iterations, recipe=recipe, prompts_per_iter=prompts_per_iter,
                pool_size=pool_size, max_policy_lag=max_policy_lag, max_gen_batches=max_gen_batches,
                eval_every=eval_every, eval_prompts=eval_prompts, run_id=run_id, threads=threads,
                keep_checkpoints=keep_checkpoints, compact_every=compact_every))
    cfg.check()  # before the buffer is created and anything is loaded
    Buffer.init(buffer).close()
    if learner_ranks > 1:
        from rollstore.loop.ranks import run_loop_with_ranks

        version = run_loop_with_ranks(cfg, learner_ranks, err)
        out.print(f"{cfg.iterations} iterations; the {learner_ranks}-rank learner published v{version}", highlight=False)
        return
    run_with_display(cfg, out)


@app.command("eval")
@guarded
def eval_(
    model: str = typer.Option("builtin:tiny", "--model"),
    prompts: str = typer.Option("builtin:arith:heldout", "--prompts"),
    samples: int = count(8, "--samples", "-n"),
    k: str = typer.Option("1,8", "--k", help="Comma-separated k values for pass@k."),
    num_prompts: Optional[int] = count(200, "--num-prompts"),
    temperature: float = positive(1.0, "--temperature"),
    max_new_tokens: int = count(12, "--max-new-tokens"),
    seed: int = seed_(0, "--seed"),
    buffer: Optional[str] = typer.Option(None, "--buffer", help="Store the results in this buffer's evaluations table."),
    format: str = typer.Option("table", "--format", "-f", help="table|json"),
):
    """pass@k (unbiased estimator) and avg@n of a model on a prompt set."""
    from rollstore.loop.evaluate import run_eval
    from rollstore.loop.generate import GenerationConfig

    ks = []
    for word in k.split(","):
        word = word.strip()
        if word and (not word.isdigit() or not 1 <= int(word) <= samples):
            fail(f"--k {k}: each k must be an integer in [1, --samples={samples}], not {word!r}", code=2)
        if word:
            ks.append(int(word))
    if not ks:
        fail("--k: give at least one k (e.g. 1,8)", code=2)
    config = GenerationConfig(group_size=samples, temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
    run_eval(model, prompts, num_prompts, config, ks, buffer, format, out)


@app.command()
@guarded
def demo(
    buffer: str = typer.Argument("demo-buffer", help="Where to put the demo buffer (replaced if it is a previous demo's)."),
    iterations: int = count(40, "--iterations", "-k"),
    recipe: str = typer.Option(RECIPE, "--recipe"),
    model: str = typer.Option("builtin:tiny", "--model"),
    seed: int = seed_(0, "--seed", help="Seed of the prompts and samples (the warm start is shared)."),
):
    """The loop on builtin:tiny + builtin:arith with the d3s recipe, in a few minutes on a CPU."""
    from rollstore.cli.demo import run_demo

    run_demo(buffer, iterations, recipe, out, model=model, seed=seed)
