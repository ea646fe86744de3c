package main

// Running Porcupine over the registers, finding and shrinking the failing ones.

import (
	"flag"
	"fmt"
	"math"
	"os"
	"sort"
	"strings"
	"time"

	"github.com/anishathalye/porcupine"
)

const (
	chunkPartitions = 20000 // registers per Porcupine call: one goroutine each, so bounded
	windowsShownMax = 5     // failing registers printed in full
	visPartitionMax = 50    // failing registers drawn in the visualization
)

type verdict struct {
	failing []string // keys of the registers that are not linearizable
	unknown bool     // timed out before every register was checked
}

// check runs Porcupine over every register, chunkPartitions at a time.
func check(keys []string, parts map[string][]porcupine.Operation, timeout time.Duration) verdict {
	deadline := time.Now().Add(timeout)
	var v verdict
	for lo := 0; lo < len(keys); lo += chunkPartitions {
		chunk := keys[lo:min(lo+chunkPartitions, len(keys))]
		left := time.Until(deadline)
		if left <= 0 {
			v.unknown = true
			return v
		}
		res := porcupine.CheckOperationsTimeout(logModel(gather(chunk, parts)), nil, left)
		switch res {
		case porcupine.Unknown:
			v.unknown = true
			return v
		case porcupine.Illegal:
			for _, k := range chunk { // which of them: each alone (they are small)
				if !linearizable(parts[k]) {
					v.failing = append(v.failing, k)
				}
			}
		}
	}
	return v
}

func gather(keys []string, parts map[string][]porcupine.Operation) [][]porcupine.Operation {
	out := make([][]porcupine.Operation, len(keys))
	for i, k := range keys {
		out[i] = parts[k]
	}
	return out
}

func linearizable(ops []porcupine.Operation) bool {
	return porcupine.CheckOperations(logModel([][]porcupine.Operation{ops}), nil)
}

// minimalWindow keeps every acknowledged append of the register and drops, in
// invocation order, every other operation (reads, and appends of unknown
// outcome, which are placed where reads saw them) whose removal leaves the
// register still not linearizable: what remains cannot be ordered, and
// without any one of its reads it could.
func minimalWindow(ops []porcupine.Operation) []porcupine.Operation {
	window := append([]porcupine.Operation(nil), ops...)
	sort.SliceStable(window, func(i, j int) bool { return window[i].Call < window[j].Call })
	for i := 0; i < len(window); {
		in := window[i].Input.(input)
		if (in.Kind == writeOffset || in.Kind == writeVal) && in.Op.Type == "ok" {
			i++
			continue
		}
		without := append(append([]porcupine.Operation(nil), window[:i]...), window[i+1:]...)
		if !linearizable(without) {
			window = without
		} else {
			i++
		}
	}
	return window
}

func describeKey(k string) string {
	if strings.HasPrefix(k, "o") {
		return "offset " + k[1:]
	}
	return fmt.Sprintf("value %q", k[1:])
}

func ms(t int64) string {
	if t == math.MaxInt64 {
		return "   never"
	}
	return fmt.Sprintf("%8.1f", float64(t)/1e6)
}

func printWindow(k string, ops []porcupine.Operation) {
	window := minimalWindow(ops)
	fmt.Printf("  %s: not linearizable; minimal failing window, %d of its %d operations "+
		"(ms since the drill began, invoke .. return):\n", describeKey(k), len(window), len(ops))
	for _, o := range window {
		fmt.Printf("    %s .. %s  %-40s %s\n", ms(o.Call), ms(o.Return), describeOp(o.Input, nil), o.Metadata)
	}
}

func visualize(path string, failing []string, parts map[string][]porcupine.Operation) error {
	shown := failing[:min(len(failing), visPartitionMax)]
	model := logModel(gather(shown, parts))
	_, info := porcupine.CheckOperationsVerbose(model, nil, 0)
	return porcupine.VisualizePath(model, info, path)
}

func summary(ops []op, keys []string) string {
	var acked, info, reads, offsets int
	for _, o := range ops {
		switch {
		case o.F == "append" && o.Type == "ok":
			acked++
		case o.F == "append" && o.Type == "info":
			info++
		case o.F == "read" && o.Type == "ok":
			reads++
		}
	}
	for _, k := range keys {
		if strings.HasPrefix(k, "o") {
			offsets++
		}
	}
	return fmt.Sprintf("%d operations (%d appends acknowledged, %d of unknown outcome, %d reads), "+
		"%d registers (%d offsets, %d values)", len(ops), acked, info, reads, len(keys), offsets, len(keys)-offsets)
}

func main() {
	vis := flag.String("vis", "", "write Porcupine's visualization of the failing registers (HTML) here")
	timeout := flag.Duration("timeout", 300*time.Second, "give up (exit 3) after this long")
	flag.Parse()
	if flag.NArg() != 1 {
		fmt.Fprintln(os.Stderr, "usage: metalog-porcupine [-vis FILE] [-timeout D] HISTORY.jsonl")
		os.Exit(2)
	}
	f, err := os.Open(flag.Arg(0))
	if err != nil {
		fmt.Fprintf(os.Stderr, "porcupine: %v\n", err)
		os.Exit(2)
	}
	ops, err := readHistory(f)
	f.Close()
	if err != nil {
		fmt.Fprintf(os.Stderr, "porcupine: %s: %v\n", flag.Arg(0), err)
		os.Exit(2)
	}
	start := time.Now()
	keys, parts := partitions(ops)
	v := check(keys, parts, *timeout)
	took := time.Since(start).Seconds()
	switch {
	case len(v.failing) > 0:
		fmt.Printf("porcupine: NOT linearizable: %d of %d registers (%s, %.1f s)\n",
			len(v.failing), len(keys), summary(ops, keys), took)
		for _, k := range v.failing[:min(len(v.failing), windowsShownMax)] {
			printWindow(k, parts[k])
		}
		if len(v.failing) > windowsShownMax {
			fmt.Printf("  (+%d more: %s ...)\n", len(v.failing)-windowsShownMax,
				strings.Join(v.failing[windowsShownMax:min(len(v.failing), windowsShownMax+10)], ", "))
		}
		if *vis != "" {
			if err := visualize(*vis, v.failing, parts); err != nil {
				fmt.Fprintf(os.Stderr, "porcupine: visualization: %v\n", err)
			} else {
				fmt.Printf("  visualization: %s\n", *vis)
			}
		}
		os.Exit(1)
	case v.unknown:
		fmt.Printf("porcupine: UNKNOWN: timed out after %s (%s)\n", *timeout, summary(ops, keys))
		os.Exit(3)
	}
	fmt.Printf("porcupine: linearizable: %s, %.1f s\n", summary(ops, keys), took)
}
