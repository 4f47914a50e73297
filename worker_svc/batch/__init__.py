"""The persistent batch (rows, block table, host staging) and the checks that guard it."""
