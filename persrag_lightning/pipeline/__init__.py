"""The main job as a room of its own. `command.py` is `persrag pipeline`: it parses the command
line and runs the job in this process (`LocalRunner`: through the train and evaluate commands, so
the room sits above `commands/`). A frozen `Job` (job.py) is resolved once from a preset and the
command line; its stages and evaluations are runs (runs.py); the dev choice and its candidates are
choice.py; the plan and its estimate are plan.py and rates.py (constants.py reads
plan_constants.json); the machine's decisions are decisions.py; the main job's order is flow.py;
what ran, and pipeline.json, are execution.py.
"""

# the package's modules, imported on use
__all__ = ["choice", "command", "constants", "decisions", "execution", "flow", "job", "plan", "rates", "runs"]
