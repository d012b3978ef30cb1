"""``raylane tune JOB``: a hyperparameter search of any job, each trial a raylane run."""

from __future__ import annotations

import sys
from typing import List, Optional

import typer


def register(app: typer.Typer) -> None:
    from raylane.cli.app import ADDRESS_HELP

    @app.command()
    def tune(
        job: str = typer.Argument(..., help="The job to search: a registered name, path/to/file.py:NAME or package.module:NAME."),
        search: List[str] = typer.Option([], "--search", "-S", help="key=SPEC: uniform(a,b), loguniform(a,b), randint(a,b) (both ends included), choice([..]) or grid([..]) (repeatable)."),
        search_file: Optional[str] = typer.Option(None, "--search-file", help="YAML mapping of keys to specs (nested mappings are dotted keys)."),
        set_: List[str] = typer.Option([], "--set", "-s", help="A key fixed for every trial: key=value (repeatable)."),
        config: Optional[str] = typer.Option(None, "--config", "-c", help="YAML file of values fixed for every trial."),
        metric: Optional[str] = typer.Option(None, help="Metric to optimise (default: the job's main metric)."),
        mode: Optional[str] = typer.Option(None, help="max or min (default: from the metric's name)."),
        trials: int = typer.Option(4, help="Samples of the space (each grid point this many times)."),
        concurrency: int = typer.Option(2, help="Trials running at once."),
        scheduler: str = typer.Option("none", help="none, asha (early stopping) or pbt (population-based training)."),
        name: Optional[str] = typer.Option(None, help="The search's folder under --runs-dir (default: tune-JOB-DATE-TIME)."),
        runs_dir: str = typer.Option("runs", help="Folder of the search's folder."),
        max_failures: int = typer.Option(3, help="Restarts of one trial from its newest checkpoint before it is an error."),
        trial_cpus: float = typer.Option(0.5, help="CPUs held by each trial's driver (its actors are placed by raylane)."),
        grace_steps: int = typer.Option(2, help="ASHA: steps every trial runs before it may be stopped."),
        perturbation_interval: int = typer.Option(0, help="PBT: steps between exploits (0: the job's driver.checkpoint_every_steps)."),
        pbt_synch: bool = typer.Option(False, "--pbt-synch", help="PBT: trials wait for each other at every perturbation step "
                                       "(each wait a stop and resume at the checkpoint); without it a trial finished early is out of the comparison."),
        seed: Optional[int] = typer.Option(None, help="Seed of the sampling."),
        address: Optional[str] = typer.Option(None, help=ADDRESS_HELP),
    ) -> None:
        """Search a job's hyperparameters with Ray Tune (random, grid, ASHA or PBT); every trial is a raylane run
        with its own placement, pools, checkpoints and recovery, restarted by Tune from its newest checkpoint when its process is lost.

        Example: raylane tune linreg --search lr=loguniform(0.05,0.5) --trials 4 --scheduler asha"""
        import yaml

        from raylane.config_yaml import safe_load
        from rich.console import Console

        from raylane import config as cfg
        from raylane import registry, session
        from raylane.tune import results as tune_results
        from raylane.cli.app import connect_failed, end, fail
        from raylane.runpaths import RunPathError, check_run_name
        from raylane.tune.run import Search, search_folder, tune
        from raylane.tune.space import SearchSpaceError, parse_search, space_from_mapping
        from raylane.workload import default_run_name

        # piped to a file or a job's log: wide enough for the table of trials, not rich's 80 columns
        console = Console() if sys.stdout.isatty() else Console(width=160)
        try:
            space = parse_search(search)
            if search_file is not None:
                try:
                    with open(search_file, encoding="utf-8") as fh:
                        more = space_from_mapping(safe_load(fh) or {})
                except (OSError, ValueError, yaml.YAMLError) as exc:  # ValueError: YAMLRefused, UnicodeDecodeError
                    raise SearchSpaceError(f"--search-file {search_file}: {exc}") from None
                if both := sorted(set(more) & set(space)):
                    raise SearchSpaceError(f"{', '.join(both)}: searched both in --search and in --search-file; keep one")
                space.update(more)
            folder_name = check_run_name(name or default_run_name(f"tune-{job.rsplit(':', 1)[-1].rsplit('/', 1)[-1]}"), "--name")
            s = Search(job=job, space=space, overrides=list(set_), config_file=config, metric=metric, mode=mode, trials=trials,
                       concurrency=concurrency, scheduler=scheduler, name=folder_name, runs_dir=runs_dir, max_failures=max_failures,
                       trial_cpus=trial_cpus, grace_steps=grace_steps, perturbation_interval=perturbation_interval, pbt_synch=pbt_synch,
                       seed=seed)
            prep, rows, files = tune(s, address=address, say=lambda m: console.print(m, highlight=False, markup=False))
        except (SearchSpaceError, registry.UnknownJobError, cfg.ConfigError, RunPathError) as exc:
            fail(str(exc))
        except session.ConnectError as exc:
            connect_failed(exc)
        folder = search_folder(s)
        console.print(tune_results.table(rows, prep.metric))
        for kind, path in files.items():
            console.print(f"{kind}: {path}", highlight=False)
        best = tune_results.best(rows, prep.metric)
        if best is None:
            failed = [r for r in rows if r["state"] == "error"]
            for r in failed:
                console.print(f"trial {r['trial']} failed: {(r.get('error') or 'see its folder').splitlines()[0]}", highlight=False, markup=False)
            what = f"all {len(rows)} trials failed" if rows and len(failed) == len(rows) else f"no trial that did not fail reported {prep.metric}"
            fail(f"{what}; no best trial. See the trials' folders under {folder / 'trials'}", code=1)
        console.print(f"best trial {best['trial']}: {prep.metric}={best[f'best_{prep.metric}']:.6g}; to run it alone:", highlight=False)
        console.print(tune_results.command_line(prep.spec.name if ":" not in job else job, s.overrides, config, best),
                      highlight=False, markup=False, soft_wrap=True)
        errors = sum(1 for r in rows if r["state"] == "error")
        end(1 if errors else 0)
