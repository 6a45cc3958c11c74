"""The state on disk: the state document and its writer."""
