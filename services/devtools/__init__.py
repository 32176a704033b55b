"""Developer tools run by the Makefile (code generation), not by the services."""
