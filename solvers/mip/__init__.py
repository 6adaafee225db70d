"""The keep/recompute integer program and its backends (HiGHS, CBC, CP-SAT), shared by every exact planner.

``keep_model`` builds the program, ``run_keep`` runs it once for a budget and says what the answer
proves, ``solve`` picks a backend and decides which answer to believe, ``backend_run`` and
``cpsat`` are the raw backend runs, ``min_cut`` the program without its budget row (a min cut).
"""
