package main

// The log's model, projected per offset and per value (see main.go).

import (
	"fmt"
	"sort"
	"strconv"

	"github.com/anishathalye/porcupine"
)

type kind uint8

const (
	writeOffset kind = iota // the record at Offset is Value (an append put it there)
	readOffset              // a read found Value at Offset, or a control record there (Control)
	writeVal                // Value was appended at Offset (-1: an info append, offset unknown)
	readVal                 // a read found Value at Offset
)

// input is one operation projected onto one register (offset or value).
type input struct {
	Kind    kind
	Offset  int64
	Value   string
	Control bool
	Op      *op // the whole-log operation it comes from, for the window
}

// state of one register: for an offset, Set is 0 unset, 1 data (Value), 2
// control; for a value, Set is 0 unset, 1 appended at Offset (-1 unknown).
type state struct {
	Set    uint8
	Value  string
	Offset int64
}

const (
	unset   = 0
	data    = 1
	control = 2
)

func stepFn(s0, in0, _ interface{}) (bool, interface{}) {
	s, in := s0.(state), in0.(input)
	switch in.Kind {
	case writeOffset: // an offset holds one record, written once
		return s.Set == unset, state{Set: data, Value: in.Value}
	case readOffset:
		if in.Control { // the read passed over it: a control record, now and forever
			return s.Set == unset || s.Set == control, state{Set: control}
		}
		return s.Set == data && s.Value == in.Value, s
	case writeVal: // a value is appended once
		return s.Set == unset, state{Set: data, Offset: in.Offset}
	case readVal: // ... and found at one offset only
		if s.Set != data {
			return false, s
		}
		if s.Offset == -1 { // an info append: the first read tells where it went
			return true, state{Set: data, Offset: in.Offset}
		}
		return s.Offset == in.Offset, s
	}
	return false, s
}

func describeOp(in0, _ interface{}) string {
	in := in0.(input)
	switch in.Kind {
	case writeOffset:
		return fmt.Sprintf("append put %q at %d", in.Value, in.Offset)
	case readOffset:
		if in.Control {
			return fmt.Sprintf("read passed %d (control)", in.Offset)
		}
		return fmt.Sprintf("read %d -> %q", in.Offset, in.Value)
	case writeVal:
		if in.Offset < 0 {
			return fmt.Sprintf("append %q (outcome unknown)", in.Value)
		}
		return fmt.Sprintf("append %q acknowledged at %d", in.Value, in.Offset)
	default:
		return fmt.Sprintf("read found %q at %d", in.Value, in.Offset)
	}
}

func describeState(s0 interface{}) string {
	s := s0.(state)
	switch {
	case s.Set == unset:
		return "unset"
	case s.Set == control:
		return "control record"
	case s.Value != "":
		return strconv.Quote(s.Value)
	case s.Offset < 0:
		return "appended, offset not yet seen"
	default:
		return fmt.Sprintf("at offset %d", s.Offset)
	}
}

// logModel checks the given partitions (registers) as Porcupine's partitioning.
func logModel(parts [][]porcupine.Operation) porcupine.Model {
	return porcupine.Model{
		Partition:         func([]porcupine.Operation) [][]porcupine.Operation { return parts },
		Init:              func() interface{} { return state{} },
		Step:              stepFn,
		DescribeOperation: describeOp,
		DescribeState:     describeState,
		DescribeOperationMetadata: func(m interface{}) string {
			if m == nil {
				return ""
			}
			return m.(string)
		},
	}
}

// partitions projects the whole-log operations onto one register per offset
// ("o<offset>") and per value ("v<value>"); keys in a stable order.
func partitions(ops []op) ([]string, map[string][]porcupine.Operation) {
	parts := map[string][]porcupine.Operation{}
	add := func(key string, o *op, in input) {
		where := fmt.Sprintf("history line %d", o.Line)
		if o.Line == 0 {
			where = "never completed"
		}
		parts[key] = append(parts[key], porcupine.Operation{
			ClientId: o.Client, Input: in, Call: o.Call, Return: o.Return,
			Metadata: fmt.Sprintf("%s %s (%s)", o.Process, o.Type, where)})
	}
	readAt := map[string][]int64{} // value -> offsets reads found it at
	for i := range ops {
		if ops[i].F == "read" && ops[i].Type == "ok" {
			for _, r := range ops[i].Records {
				readAt[r.Value] = append(readAt[r.Value], r.Offset)
			}
		}
	}
	for i := range ops {
		o := &ops[i]
		switch {
		case o.F == "append" && o.Type == "ok":
			for j, v := range o.Values {
				at := o.Offset + int64(j)
				add(offsetKey(at), o, input{Kind: writeOffset, Offset: at, Value: v, Op: o})
				add("v"+v, o, input{Kind: writeVal, Offset: at, Value: v, Op: o})
			}
		case o.F == "append" && o.Type == "info":
			for _, v := range o.Values { // happened only if some read saw it
				seen := uniq(readAt[v])
				for _, at := range seen {
					add(offsetKey(at), o, input{Kind: writeOffset, Offset: at, Value: v, Op: o})
				}
				if len(seen) > 0 {
					add("v"+v, o, input{Kind: writeVal, Offset: -1, Value: v, Op: o})
				}
			}
		case o.F == "read" && o.Type == "ok":
			addRead(o, add)
		} // a failed append never happened; a failed read claims nothing
	}
	return sortedKeys(parts), parts
}

func addRead(o *op, add func(string, *op, input)) {
	found := make(map[int64]string, len(o.Records))
	for _, r := range o.Records {
		found[r.Offset] = r.Value
	}
	for at := o.From; at < o.Next; at++ {
		v, ok := found[at]
		add(offsetKey(at), o, input{Kind: readOffset, Offset: at, Value: v, Control: !ok, Op: o})
		if ok {
			add("v"+v, o, input{Kind: readVal, Offset: at, Value: v, Op: o})
		}
	}
}

func offsetKey(at int64) string { return "o" + strconv.FormatInt(at, 10) }

func uniq(xs []int64) []int64 {
	sort.Slice(xs, func(i, j int) bool { return xs[i] < xs[j] })
	out := xs[:0:0]
	for i, x := range xs {
		if i == 0 || x != xs[i-1] {
			out = append(out, x)
		}
	}
	return out
}
