"""Speculative decoding: the drafters (drafters.py; a draft model, draft_model.py; the model's own
next-token layer, mtp_drafter.py) and the policy that decides when and how far to draft (speculation.py)."""
