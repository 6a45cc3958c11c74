"""The test world shared by the integration tests and the demo."""
