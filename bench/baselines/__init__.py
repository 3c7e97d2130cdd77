"""The servers vitserve is measured against: what a user would write instead."""
