"""Print the context study's record as the docs quote it (docs/experiments.md section 1): per-seed final
losses, gaps to softmax@rope with band overlap, margins to the trigram, spikes, loss by position against the
trigram, the same-time comparison and the longest-context runs. Usage: python tools/context_tables.py [context.json]"""
import json, sys
d = json.load(open(sys.argv[1] if len(sys.argv) > 1 else 'docs/results/experiments/context/context.json'))
s = d['summary']; mechs = list(s['final_val_loss_per_seed'])
print("chosen lr:", d['lr']); print("edge:", d['lr_at_grid_edge'])
for sw in d['sweep']:
    print("sweep", sw['context'], {m: [(x['lr'], round(x['score'], 3)) for x in t] for m, t in sw['table'].items()})
for m in mechs:
    print(f"\n== {m}")
    for T, v in s['final_val_loss_per_seed'][m].items():
        g = s['gap_to_softmax@rope'][m][T]; t = s['minus_trigram'][m][T]
        print(f"  T={T}: per seed {[round(x, 3) for x in v]}  gap {g['mean']:+.3f} [{g['min']:+.3f},{g['max']:+.3f}] "
              f"overlap={s['band_overlaps_softmax@rope'][m][T]}  -trigram {t['mean']:+.3f} [{t['min']:+.3f},{t['max']:+.3f}]"
              f"  spikes {s['spikes'][m][T]['count']['mean']:.0f} ({s['spikes'][m][T]['count']['min']}-{s['spikes'][m][T]['count']['max']})")
    for T, bp in s['by_position'][m].items():
        tri = d['baselines']['by_position']['trigram'][T]
        print(f"  by position T={T}: mean {[round(x, 3) for x in bp['mean']]}  minus trigram {[round(a - b, 3) for a, b in zip(bp['mean'], tri)]}")
st = s.get('same_time')
if st:
    print("\nsame_time ref finish", round(st['reference_finish_seconds']), "fastest", round(st['fastest_finish_seconds']))
    for m, v in st['mechanisms'].items():
        print(f"  {m}: finish {v['finish_seconds']['mean']:.0f} [{v['finish_seconds']['min']:.0f},{v['finish_seconds']['max']:.0f}]",
              {k: round(x['mean'], 3) for k, x in v.items() if k != 'finish_seconds' and isinstance(x, dict) and 'mean' in x})
for r in d['runs']:
    if r['context'] == d['settings']['contexts'][-1]:
        print(r['attention'], r['seed'], r['lr'], round(r['train_seconds']), r['params'], r['machine'].get('cpu', '')[:40], round(r['final_val_loss'], 3))
