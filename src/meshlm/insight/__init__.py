"""Looking at a configuration before and while it runs: the planner, the startup report,
measured activation memory, benchmark sweeps and HLO inspection."""
