"""Rounds of Expert Iteration (`winnow rounds`): generate with the round's model, build the SFT set, fine-tune with
TRL, evaluate on held-out prompts, start again from the new model; and what each round bought and cost.

`rounds.config` (the recipe config), `rounds.recipe` (the steps, resumable), `rounds.ledger` (``recipe.json``),
`rounds.train` (the fine-tune), `rounds.summary` (the summary files). The numbers of a round are
`reporting.rounds`'. docs/expert-iteration.md has the whole story.
"""
