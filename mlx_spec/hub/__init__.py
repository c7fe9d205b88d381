"""A model named by a Hugging Face repo id: its files fetched, with the MTP
files mlx-lm's downloads leave out.

- ``resolve.py``: a name as a local path or a repo id, downloaded as
  mlx-lm downloads it, plus the MTP files; every failure a ``HubError``;
- ``mtp_ranges.py``: which bytes of a safetensors checkpoint are its MTP
  tensors (the index and the shard headers, checked);
- ``mtp_fetch.py``: ``convert --mtp-from``'s range reads of those bytes
  alone (resumed, locked per shard, the whole shard where ranges are refused).
"""
