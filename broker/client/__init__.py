"""The client library: produce, read, administer a metalog cluster. Nothing of the server."""
