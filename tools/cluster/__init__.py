"""Local clusters: the process launcher, the docker-compose runner and the cluster's certificates."""
