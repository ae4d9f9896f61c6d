"""The model side: slot handlers that run a real model over the slot pool (optional extra ``model``)."""
