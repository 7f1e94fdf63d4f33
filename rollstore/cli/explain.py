"""`rollstore recipes --explain NAME`: a recipe read as the plan it runs, step by step.

Invariants: what is printed is `curate.plan.build` of the resolved parameters, the same object the
engines run and hash; nothing here re-derives the plan. Values known only at run time (the default
batch, μ, the token threshold) are marked so. A custom `.sql` recipe shows its SELECT as one step.
"""

from __future__ import annotations

from rich.console import Console

from rollstore.curate.params import Params, load_recipe, parse_sets, resolve
from rollstore.curate.plan import Plan, build, explain
from rollstore.curate.prompts import prompt_plan, rates_text

LATEST = "run_id = <the latest run> AND step = <its latest step>"  # resolved at run time


def training_line(recipe) -> str:
    """What `rollstore loop` trains a recipe's curations with: μ and the learning rate of its TOML, or
    the loop's defaults where the recipe sets none (`LoopConfig.effective_train`)."""
    from rollstore.loop.driver import LoopConfig

    train = LoopConfig(buffer="", recipe=recipe.name if recipe.sql is None else "grpo").train
    epochs = f"{recipe.epochs} (the recipe's)" if recipe.epochs is not None else f"{train.epochs} (the loop's default)"
    lr = f"{recipe.lr:g} (the recipe's)" if recipe.lr is not None else f"{train.lr:g} (the loop's default)"
    return (f"training (rollstore loop): epochs μ {epochs}, lr {lr}, loss {train.loss}; --epochs / --lr override "
            "them; `rollstore train` takes its own")


def print_plan(recipe_ref: str, sets: list[str], out: Console) -> None:
    recipe = load_recipe(recipe_ref)
    params = resolve(recipe, parse_sets(sets))
    values = dict(params.values)
    if values["where"] is None:
        values["where"] = LATEST
    plan = build(Params(values, params.user_set), recipe, recipe.sql.strip() if recipe.sql is not None else None)
    if params["current_version"] is None:
        plan.values.pop("current_version")  # shown as "(at run time)"
    say = lambda text="": out.print(text, highlight=False, markup=False, soft_wrap=True)  # noqa: E731
    say(f"recipe {recipe.name}: {recipe.description}")
    say(f"parameters {params.to_json()}")
    say(training_line(recipe))
    if params["current_version"] is None:
        say("current_version: the newest version of the batch's own run: its newest checkpoint, else its newest "
            "policy_version (at run time; docs/choices.md §Runs)")
    say()
    skipping = prompt_plan(params)
    if skipping is not None:
        _rows(skipping, say, "P")
        say(f"      {rates_text(params)} (prompt selection's plan sha256 {skipping.sha256()[:16]}…)")
        say()
    _rows(plan, say)
    say()
    kernels = sum(s.kernel is not None for s in plan.steps)
    say(f"{len(plan.steps)} steps ({len(plan.steps) - kernels} SQL, {kernels} kernel). The curation id hashes their "
        f"text and each kernel's name, version and arguments (plan sha256 {plan.sha256()[:16]}…) with the snapshot, "
        "the recipe name and the parameters.")


def _rows(plan: Plan, say, mark: str = "") -> None:
    """The plan's `explain` rows, one block per step (numbered `mark`1, `mark`2, … when `mark`)."""
    for row in explain(plan):
        say(f"{mark + str(row['step']):>2}. {row['phase']:<11} {row['scope']:<6} {row['sql']}")
        say(f"      runs {row['at']}")
        say(f"      reads {', '.join(row['reads']) or '-'}  →  writes {', '.join(row['writes'])}")
        for use in row["uses"]:
            say(f"      {use}")
