"""The main job as a room of its own: a frozen `Job` (job.py) resolved once from a preset and the
command line, the stages and evaluations it runs (runs.py) through a `Runner` the commands give it,
the dev choice (choice.py) among the candidates (candidates.py), the plan and its estimate (plan.py,
rates.py, constants.py with plan_constants.json), the machine's decisions (decisions.py), the
order of the main job (flow.py), what ran (execution.py) and pipeline.json (recording.py).
`commands/pipeline.py` parses the command line and calls `flow`.
"""

# the package's modules, imported on use
__all__ = ["candidates", "choice", "constants", "decisions", "execution", "flow", "job", "plan", "rates",
           "recording", "runs", "task_switch"]
