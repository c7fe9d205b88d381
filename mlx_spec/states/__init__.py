"""Kept decoder states: a sequence's whole state as values and where it is
kept.

- ``snapshot.py``: a decoder's state as values (capture, check, restore);
- ``memory.py``: the states a server keeps in memory between requests;
- ``file.py``: one state as one file, every field checked on reading;
- ``store.py``: the disk tier under the states in memory (a directory of
  its own, shared by servers and chats);
- ``session_file.py``: a chat session saved to and loaded from one file.
"""
