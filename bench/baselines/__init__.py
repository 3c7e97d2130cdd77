"""Servers the vitserve service is measured against."""
