"""``raylane tune``: hyperparameter searches of any job with Ray Tune, each trial a raylane run.

- :mod:`raylane.tune.space`: the search space as given (``--search``, ``--search-file``), typed and checked.
- :mod:`raylane.tune.run`: preparing a search (every refusal before Ray starts) and running it.
- :mod:`raylane.tune.trial`: one trial, a raylane run stepped by Ray Tune.
- :mod:`raylane.tune.results`: the trials' table, files, plot and the best trial's command line.
"""
