"""The network: the request server, outbound peer channels, TLS, principals and back-off."""
