// A batchwire client in Go, built from the .proto files alone (the generated package is made at
// test time by protoc-gen-go and protoc-gen-go-grpc; see tests/client_api/test_go_client.py).
// Usage: client HOST:PORT PROMPT MAX_TOKENS
// Prints one JSON object: a streamed greedy completion, an n = 2 request with prompt logprobs,
// the status of a request with a bad field, and the tool calls of a chat with a strict tool
// under TOOL_CHOICE_AUTO, with parallel calls and with parallel_tool_calls false.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strconv"
	"time"

	pb "batchwire/v1"

	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
)

type completion struct {
	TokenIDs     []int32 `json:"token_ids"`
	Text         string  `json:"text"`
	Messages     int     `json:"messages"`
	FinishReason string  `json:"finish_reason"`
	Completion   int32   `json:"completion_tokens"`
}

type parallel struct {
	TokenIDs       map[int32][]int32 `json:"token_ids"` // by sequence index
	FinishReasons  map[int32]string  `json:"finish_reasons"`
	PromptLogprobs []float32         `json:"prompt_logprobs"`
	PromptTokenIDs []int32           `json:"prompt_logprob_token_ids"`
	Completion     int32             `json:"completion_tokens"`
	PromptTokens   int32             `json:"prompt_tokens"`
}

type refusal struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

type call struct {
	ID        string `json:"id"`
	Name      string `json:"name"`
	Arguments string `json:"arguments"`
}

type toolReply struct {
	Calls        []call `json:"calls"`
	FinishReason string `json:"finish_reason"`
}

func ptr[T any](v T) *T { return &v }

// The model was shown one turn that called get_weather for two cities; asked about two more, it
// calls it again. The last message of the sequence carries the calls its text holds.
func toolCalls(ctx context.Context, client pb.GenerationClient, parallel bool) (toolReply, error) {
	city := `{"type": "object", "properties": {"city": {"type": "string"}}, ` +
		`"required": ["city"], "additionalProperties": false}`
	earlier := []*pb.ToolCall{
		{Id: "call_1", Name: "get_weather", Arguments: `{"city": "Rome"}`},
		{Id: "call_2", Name: "get_weather", Arguments: `{"city": "Oslo"}`},
	}
	req := &pb.GenerateRequest{
		Messages: []*pb.ChatMessage{
			{Role: "user", Content: "Weather in Rome and in Oslo?"},
			{Role: "assistant", ToolCalls: earlier},
			{Role: "user", Content: "Weather in Paris and in London?"},
		},
		Tools:             []*pb.Tool{{Name: "get_weather", Parameters: city, Strict: true}},
		ParallelToolCalls: ptr(parallel),
		Sampling:          &pb.SamplingParams{Temperature: ptr(float32(0)), MaxTokens: ptr(int32(50))},
	}
	var reply toolReply
	err := stream(ctx, client, req, func(m *pb.GenerateResponse) {
		for _, c := range m.ToolCalls {
			reply.Calls = append(reply.Calls, call{c.Id, c.Name, c.Arguments})
		}
		if m.FinishReason != nil {
			reply.FinishReason = *m.FinishReason
		}
	})
	return reply, err
}

func stream(ctx context.Context, client pb.GenerationClient, req *pb.GenerateRequest,
	each func(*pb.GenerateResponse)) error {
	call, err := client.Generate(ctx, req)
	if err != nil {
		return err
	}
	for {
		msg, err := call.Recv()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
		each(msg)
	}
}

func main() {
	if len(os.Args) != 4 {
		fmt.Fprintln(os.Stderr, "usage: client HOST:PORT PROMPT MAX_TOKENS")
		os.Exit(2)
	}
	address, prompt := os.Args[1], os.Args[2]
	maxTokens, err := strconv.Atoi(os.Args[3])
	if err != nil {
		fmt.Fprintln(os.Stderr, "MAX_TOKENS:", err)
		os.Exit(2)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	conn, err := grpc.DialContext(ctx, address, grpc.WithInsecure(), grpc.WithBlock())
	if err != nil {
		fail("dial", err)
	}
	defer conn.Close()
	client := pb.NewGenerationClient(conn)

	// `optional` fields are pointers: an explicit 0 is sent, so temperature 0 means greedy.
	greedy := &pb.SamplingParams{Temperature: ptr(float32(0)), MaxTokens: ptr(int32(maxTokens)),
		IgnoreEos: ptr(true)}
	var one completion
	err = stream(ctx, client, &pb.GenerateRequest{Text: &prompt, Sampling: greedy},
		func(m *pb.GenerateResponse) {
			one.TokenIDs = append(one.TokenIDs, m.TokenIds...)
			one.Text += m.Text
			one.Messages++
			if m.FinishReason != nil {
				one.FinishReason = *m.FinishReason
				one.Completion = m.GetUsage().GetCompletionTokens()
			}
		})
	if err != nil {
		fail("generate", err)
	}

	two := parallel{TokenIDs: map[int32][]int32{}, FinishReasons: map[int32]string{}}
	sampling := &pb.SamplingParams{Temperature: ptr(float32(0)), MaxTokens: ptr(int32(maxTokens)),
		IgnoreEos: ptr(true), N: ptr(int32(2)), PromptLogprobs: ptr(int32(0))}
	err = stream(ctx, client, &pb.GenerateRequest{Text: &prompt, Sampling: sampling},
		func(m *pb.GenerateResponse) {
			two.TokenIDs[m.Index] = append(two.TokenIDs[m.Index], m.TokenIds...)
			for _, lp := range m.PromptLogprobs {
				two.PromptLogprobs = append(two.PromptLogprobs, lp.Logprob)
				two.PromptTokenIDs = append(two.PromptTokenIDs, lp.TokenId)
			}
			if m.FinishReason != nil {
				two.FinishReasons[m.Index] = *m.FinishReason
			}
			if m.Usage != nil {
				two.Completion = m.Usage.CompletionTokens
				two.PromptTokens = m.Usage.PromptTokens
			}
		})
	if err != nil {
		fail("generate n=2", err)
	}

	var bad refusal
	err = stream(ctx, client, &pb.GenerateRequest{Text: &prompt,
		Sampling: &pb.SamplingParams{N: ptr(int32(0))}}, func(*pb.GenerateResponse) {})
	if err == nil {
		fail("n=0", fmt.Errorf("the server accepted n = 0"))
	}
	st := status.Convert(err)
	bad.Code, bad.Message = st.Code().String(), st.Message()

	tools := map[string]toolReply{}
	for name, parallel := range map[string]bool{"parallel": true, "single": false} {
		if tools[name], err = toolCalls(ctx, client, parallel); err != nil {
			fail("tool calls", err)
		}
	}

	out, _ := json.Marshal(map[string]any{"completion": one, "parallel": two, "refusal": bad,
		"tools": tools})
	fmt.Println(string(out))
}

func fail(what string, err error) {
	fmt.Fprintf(os.Stderr, "%s: %v\n", what, err)
	os.Exit(1)
}
