"""`winnow plan`: a small sweep on a seeded sample of a job's prompts, projected to the whole dataset with intervals,
and the config that answers the question asked (docs/planning.md).

`planning.sweep` (the swept method configs and their job configs), `planning.sample` (the seeded sample and the
count of the whole prompt set), `planning.projection` (the projection arithmetic, the frontier, its knee and the
answer: pure functions), `planning.planner` (the steps, resumable), `planning.render` (plan.md, the plot, the
terminal summary). The check of a plan against the full run is `reporting.plancheck` (`winnow report --plan`).
"""
