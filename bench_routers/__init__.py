"""Side-by-side benchmark of our gateway against SGLang's model gateway (dev tooling, never imported by
the product): `ppd-bench-routers`, see bench_routers/README.md."""
