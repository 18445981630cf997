"""cProfile of one 8192^2 objects slide: python benchmarks/results/objects_v2/s31/prof_synth.py"""
import cProfile, pstats, time, sys
from pipeline.synthetic import write_synthetic_slide
t=time.perf_counter()
cProfile.run("write_synthetic_slide('/tmp/p.tiff', width=8192, height=8192, label=1, seed=3, fmt='tiff', task='objects', classes=2)", "/tmp/prof.out")
print(time.perf_counter()-t)
pstats.Stats("/tmp/prof.out").sort_stats("tottime").print_stats(15)
