"""decompax.analysis: tools for finished runs.

Opening a run (`explore.load_run`), interventions, harvesting components
over many batches, the part-of-speech comparison and its summary, unit
labels and contexts, gallery picks, matching and identifiability across
runs, transcoders, clustering and attribution graphs. Imports every library
package.
"""
