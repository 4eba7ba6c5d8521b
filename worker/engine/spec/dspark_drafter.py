"""`--spec dspark:PATH`: DeepSeek V4's DSpark block drafter guesses a block of tokens in one pass
(backends/numpy/dspark.DSparkHead computes it; model/dspark_file.py reads its file).

It drafts as the next-token layer does (mtp_drafter.py): from the last token and key rows that the
target's forward pass writes into the pool for every position it computes, so a sequence's state is its
tokens and its block table, and nothing is rolled back when guesses are refused. Its block is at most the
file's block size long: llama.cpp clamps --spec-draft-n-max to it. The target model checks the draft as it
checks any other (speculation.py), so the output is the model's own whatever the drafter guesses.
"""

from __future__ import annotations

from .mtp_drafter import MtpDrafter

DSPARK_MATCH = 8  # the "match length" its drafts report to the policy (speculation.MATCH_PRIOR): a trained
# drafter's first guesses stand about as often as the next-token layer's


class DSparkDrafter(MtpDrafter):
    """MtpDrafter's proposals (k guesses after the last token, from the pool), made by a block drafter."""

    name = "dspark"
    match = DSPARK_MATCH
