"""The numpy reference backend: readable, exact, and what CI runs (backend.py; DeepSeek V4's hyper-connected
stack in hyper.py and its next-token layer in mtp.py)."""
