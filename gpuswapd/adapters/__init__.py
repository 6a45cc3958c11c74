"""Adapters: one module per outside system; nothing else imports their libraries."""
