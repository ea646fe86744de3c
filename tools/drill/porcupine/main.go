// Command metalog-porcupine checks a metalog drill's history with Porcupine,
// a linearizability checker we did not write (github.com/anishathalye/porcupine).
//
// Usage: metalog-porcupine [-vis FILE] [-timeout 120s] HISTORY.jsonl
//
// The history (docs/drills.md, "The history") is JSON lines: one "meta" line,
// then an invoke line and a completion line (ok / fail / info) for every
// append and every read, per process at most one outstanding operation.
//
// The model is a log: an append of n values returns the base offset N and
// puts them at N..N+n-1; a read from position P to position Q returns every
// data record in [P, Q) with its offset, every offset it skips being a
// control record; an offset holds one record, once and for all. Checking the
// whole log as one state is exponential in the concurrent operations, so the
// history is projected (Porcupine's partitioning) onto one register per
// offset and one per value:
//
//   - offset N: unset -> data(v) by the append acknowledged at N (write once),
//     or -> control by a read that passed over N; a read of N must see the
//     register's record;
//   - value v: unset -> at(N) by its acknowledged append (written once), and
//     every read of v must find it at that one offset.
//
// A linearizable log makes every projection linearizable, so every violation
// reported is real; the projections do not capture every property of the whole
// log (density of offsets never read, for one), which the drill's own checker
// covers. An append whose outcome is unknown (info) may or may not have
// happened: it is placed only where a read saw its values, and then it may
// take effect any time after its invocation (Porcupine's pending operation,
// its return at +infinity). A failed read claims nothing and is dropped.
//
// Exit status: 0 linearizable, 1 a violation (the minimal failing window is
// printed, and with -vis Porcupine's visualization of the failing partitions
// is written), 2 the history cannot be read, 3 the check timed out.
package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"sort"
	"strings"
)

// ---------------------------------------------------------------- history

// line is one JSON line of the history file.
type line struct {
	Type    string          `json:"type"` // meta, invoke, ok, fail, info
	Process string          `json:"process"`
	F       string          `json:"f"` // append, read
	Value   json.RawMessage `json:"value"`
	Time    int64           `json:"time"` // ns, monotonic since the drill began
	Error   string          `json:"error"`
	Format  string          `json:"format"`
}

type appendValue struct {
	Values []string `json:"values"`
	Offset *int64   `json:"offset"`
	Epoch  int64    `json:"epoch"`
}

type readValue struct {
	From    int64             `json:"from"`
	Next    int64             `json:"next"`
	Records []json.RawMessage `json:"records"` // [offset, value, epoch]
}

type record struct {
	Offset int64
	Value  string
}

// op is one completed operation of the whole log.
type op struct {
	Process string
	Client  int
	F       string
	Type    string // ok, fail, info
	Call    int64
	Return  int64
	Values  []string // append
	Offset  int64    // append ok: base offset
	From    int64    // read
	Next    int64    // read
	Records []record // read
	Line    int      // of the completion, 1-based
}

const maxLineBytes = 64 << 20 // a final read of the whole log is one long line

func readHistory(r io.Reader) ([]op, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), maxLineBytes)
	pending := map[string]*op{}
	clients := map[string]int{}
	var ops []op
	n := 0
	for sc.Scan() {
		n++
		if len(strings.TrimSpace(sc.Text())) == 0 {
			continue
		}
		var l line
		if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
			return nil, fmt.Errorf("line %d: %v", n, err)
		}
		if l.Type == "meta" {
			if l.Format != "metalog-history/1" {
				return nil, fmt.Errorf("line %d: format %q, expected metalog-history/1", n, l.Format)
			}
			continue
		}
		done, err := step(pending, clients, l, n)
		if err != nil {
			return nil, fmt.Errorf("line %d: %v", n, err)
		}
		if done != nil {
			ops = append(ops, *done)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	// An operation invoked but never completed (the drill stopped first) is
	// an append of unknown outcome, or a read that claims nothing.
	for _, p := range sortedKeys(pending) {
		o := pending[p]
		o.Type, o.Return = "info", math.MaxInt64
		ops = append(ops, *o)
	}
	return ops, nil
}

func step(pending map[string]*op, clients map[string]int, l line, n int) (*op, error) {
	if l.F != "append" && l.F != "read" {
		return nil, fmt.Errorf("unknown f %q", l.F)
	}
	if _, ok := clients[l.Process]; !ok {
		clients[l.Process] = len(clients)
	}
	if l.Type == "invoke" {
		if pending[l.Process] != nil {
			return nil, fmt.Errorf("process %s invokes while an operation is outstanding", l.Process)
		}
		o := &op{Process: l.Process, Client: clients[l.Process], F: l.F, Call: l.Time}
		if err := decode(o, l.Value, true); err != nil {
			return nil, err
		}
		pending[l.Process] = o
		return nil, nil
	}
	if l.Type != "ok" && l.Type != "fail" && l.Type != "info" {
		return nil, fmt.Errorf("unknown type %q", l.Type)
	}
	o := pending[l.Process]
	if o == nil || o.F != l.F {
		return nil, fmt.Errorf("%s of %s by process %s with no matching invoke", l.Type, l.F, l.Process)
	}
	delete(pending, l.Process)
	o.Type, o.Return, o.Line = l.Type, l.Time, n
	if l.Type == "info" {
		o.Return = math.MaxInt64 // it may take effect any time after its invocation
	}
	if l.Type == "ok" {
		if err := decode(o, l.Value, false); err != nil {
			return nil, err
		}
	}
	return o, nil
}

func decode(o *op, raw json.RawMessage, invoke bool) error {
	if o.F == "append" {
		var v appendValue
		if err := json.Unmarshal(raw, &v); err != nil {
			return err
		}
		if invoke {
			o.Values = v.Values
		} else if v.Offset == nil {
			return fmt.Errorf("append ok without an offset")
		} else {
			o.Offset = *v.Offset
		}
		return nil
	}
	var v readValue
	if err := json.Unmarshal(raw, &v); err != nil {
		return err
	}
	o.From, o.Next = v.From, v.Next
	if invoke {
		return nil
	}
	if v.Next < v.From {
		return fmt.Errorf("read from %d to %d goes backwards", v.From, v.Next)
	}
	for _, r := range v.Records {
		var rec []interface{}
		if err := json.Unmarshal(r, &rec); err != nil || len(rec) < 2 {
			return fmt.Errorf("read record %s is not [offset, value, ...]", r)
		}
		off, ok1 := rec[0].(float64)
		val, ok2 := rec[1].(string)
		if !ok1 || !ok2 || int64(off) < v.From || int64(off) >= v.Next {
			return fmt.Errorf("read record %s outside [%d, %d) or mistyped", r, v.From, v.Next)
		}
		o.Records = append(o.Records, record{int64(off), val})
	}
	return nil
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}
